"""Mounting a FUSE connection: open /dev/fuse and attach it to the mount point.

- As root: mount(2) with `fd=N,rootmode=40000,user_id=U,group_id=G` plus the
  kernel's own FUSE options (`allow_other`, `default_permissions`, `max_read=`,
  `blksize=`) and SELinux's (`context="LABEL"`, `fscontext=`, `defcontext=`,
  `rootcontext=`); the generic options (`ro`, `noatime`, `nosuid`, ...) become mount
  flags, `fsname=` the mount's source and `subtype=` its type (`fuse.SUBTYPE`).
- Otherwise: `fusermount3` (setuid root) mounts, and hands the /dev/fuse
  descriptor back over the socket named by `_FUSE_COMMFD` (SCM_RIGHTS).

Like libfuse, a mount is nosuid and nodev unless `suid` or `dev` is given.
A mount's kernel knobs, by its st_dev: the readahead window (/sys/class/bdi)
and the connection's abort (fusectl).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Iterable

from .channel import open_device

# mount(2) flags (<sys/mount.h>) of the generic options; a "no" option's
# opposite clears its flag.
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_SYNCHRONOUS, MS_DIRSYNC, MS_NOATIME, MS_NODIRATIME = 16, 128, 1024, 2048
MS_RELATIME, MS_STRICTATIME, MS_LAZYTIME = 1 << 21, 1 << 24, 1 << 25
MNT_DETACH = 2
FLAG_OPTIONS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                "sync": MS_SYNCHRONOUS, "dirsync": MS_DIRSYNC, "noatime": MS_NOATIME,
                "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME,
                "strictatime": MS_STRICTATIME, "lazytime": MS_LAZYTIME}
CLEARING_OPTIONS = {"suid": MS_NOSUID, "dev": MS_NODEV, "exec": MS_NOEXEC, "async": MS_SYNCHRONOUS,
                    "atime": MS_NOATIME, "diratime": MS_NODIRATIME}
# Options the kernel's FUSE file system takes itself (fs/fuse/inode.c).
KERNEL_OPTIONS = {"allow_other", "default_permissions"}
KERNEL_VALUE_OPTIONS = {"max_read", "blksize"}
# SELinux's labels, which the LSM takes out of mount(2)'s data before FUSE
# parses it (security_sb_eat_lsm_opts); a value with commas is in double
# quotes, kept. A kernel without SELinux refuses them (EINVAL).
LSM_OPTIONS = {"context", "fscontext", "defcontext", "rootcontext"}
SEND_FD_TIMEOUT = 30.0

log = logging.getLogger(__name__)
_libc = ctypes.CDLL(None, use_errno=True)


class MountFailed(OSError):
    """mount(2) or fusermount3 failed; the message says which and why."""


def check_options(options: Iterable[str]) -> None:
    """ValueError naming the first option neither mount(2) nor FUSE takes."""
    for opt in options:
        name = opt.split("=", 1)[0]
        if name in ("fsname", "subtype") or name in FLAG_OPTIONS or name in CLEARING_OPTIONS \
                or name in KERNEL_OPTIONS or name in KERNEL_VALUE_OPTIONS \
                or name in LSM_OPTIONS:
            continue
        raise ValueError(f"mount option {opt!r} is not known; use mount flags (nosuid, nodev, "
                         f"noexec, noatime, ...), allow_other, default_permissions, max_read=N, "
                         f"blksize=N or an SELinux context=\"LABEL\"")


def split(options: Iterable[str]) -> tuple[int, list[str], str, str]:
    """(mount flags, kernel FUSE options, fsname, subtype) of an option list."""
    check_options(options)
    flags = MS_NOSUID | MS_NODEV
    kernel: list[str] = []
    fsname, subtype = "fuse", ""
    for opt in options:
        name, _, value = opt.partition("=")
        if name == "fsname":
            fsname = value
        elif name == "subtype":
            subtype = value
        elif name in FLAG_OPTIONS:
            flags |= FLAG_OPTIONS[name]
        elif name in CLEARING_OPTIONS:
            flags &= ~CLEARING_OPTIONS[name]
        else:
            kernel.append(opt)
    return flags, sorted(kernel), fsname, subtype


def mount(mountpoint: str, options: Iterable[str], use_fusermount: bool | None = None) -> int:
    """Mount a new FUSE connection on `mountpoint`; its /dev/fuse descriptor.
    mount(2) as root, fusermount3 otherwise (or when `use_fusermount`)."""
    options = list(options)
    if use_fusermount is None:
        use_fusermount = os.geteuid() != 0
    if use_fusermount:
        return _fusermount(mountpoint, options)
    flags, kernel, fsname, subtype = split(options)
    fd = open_device()
    data = ",".join([f"fd={fd}", "rootmode=40000", f"user_id={os.getuid()}",
                     f"group_id={os.getgid()}", *kernel])
    fstype = f"fuse.{subtype}" if subtype else "fuse"
    if _libc.mount(os.fsencode(fsname), os.fsencode(mountpoint), fstype.encode(), flags,
                   data.encode()) != 0:
        err = ctypes.get_errno()
        os.close(fd)
        labels = [o for o in kernel if o.partition("=")[0] in LSM_OPTIONS]
        hint = (f" ({', '.join(labels)}: only a kernel running SELinux takes these)"
                if err == errno.EINVAL and labels else "")
        raise MountFailed(err, f"mount(2) of {fsname} on {mountpoint} failed: "
                               f"{os.strerror(err)}{hint}")
    return fd


def _fusermount(mountpoint: str, options: list[str]) -> int:
    check_options(options)
    exe = shutil.which("fusermount3")
    if exe is None:
        raise MountFailed(2, "fusermount3 not found; install the fuse3 package "
                             "(`apt-get install fuse3`), or mount as root")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        proc = subprocess.run([exe, "-o", ",".join(options), "--", mountpoint],
                              pass_fds=(theirs.fileno(),), env=env, capture_output=True,
                              text=True, timeout=SEND_FD_TIMEOUT, stdin=subprocess.DEVNULL)
        theirs.close()
        if proc.returncode != 0:
            why = (proc.stderr or proc.stdout).strip() or f"exit code {proc.returncode}"
            raise MountFailed(1, f"fusermount3 could not mount {mountpoint}: {why}")
        ours.settimeout(SEND_FD_TIMEOUT)
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    finally:
        ours.close()
        theirs.close()
    if not fds:
        raise MountFailed(1, f"fusermount3 mounted {mountpoint} but sent no descriptor")
    os.set_inheritable(fds[0], False)
    return fds[0]


def unmount_lazy(mountpoint: str) -> None:
    """Detach the mount now (its open files keep it alive until closed):
    umount2(MNT_DETACH) as root, `fusermount3 -uz` otherwise."""
    if os.geteuid() == 0 and _libc.umount2(os.fsencode(mountpoint), MNT_DETACH) == 0:
        return
    exe = shutil.which("fusermount3")
    if exe is None:
        raise MountFailed(2, f"cannot unmount {mountpoint}: fusermount3 not found")
    proc = subprocess.run([exe, "-u", "-z", "--", mountpoint], capture_output=True, text=True,
                          timeout=30, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise MountFailed(1, f"cannot unmount {mountpoint}: {proc.stderr.strip()}")


def set_kernel_readahead(dev: int, kb: int) -> bool:
    """Set the readahead window of the mount whose st_dev is `dev` (its
    /sys/class/bdi entry; root only). Best effort: a mount works without it,
    with more, smaller read requests."""
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
        return True
    except OSError as exc:
        log.debug("cannot set %s to %d: %s (reads stay at the kernel's default size)",
                  path, kb, exc)
        return False


def abort_connection(dev: int) -> bool:
    """Abort the FUSE connection of the mount with st_dev `dev` (fusectl, root
    only): its waiting requests fail with ENOTCONN and its readers return."""
    try:
        with open(f"/sys/fs/fuse/connections/{os.minor(dev)}/abort", "w") as f:
            f.write("1")
        return True
    except OSError as exc:
        log.debug("cannot abort FUSE connection %d: %s", os.minor(dev), exc)
        return False
