"""The mount point: check it before mounting, recover a dead FUSE mount, unmount.

A FUSE mount whose process died (kill -9, OOM) stays in the mount table; every
access then fails with ENOTCONN ("Transport endpoint is not connected") until
someone unmounts it. `prepare` finds that case and recovers it with a lazy
unmount (`fusermount3 -uz`), so a restarted pod or service mounts again
without a human. A live mount (another fsclient, or anything else) is never
touched: that is a busy mount point and an error.

Every probe of the mount point runs with a timeout, because a FUSE mount whose
process is alive but stuck makes stat(2) block, and fsclient must answer with a
message rather than hang with it.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blockcache_client.contract.errors import BlockcacheError

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 10.0
# How long a server whose keeper died may take to notice and end its mount.
ORPHAN_WAIT = 10.0
FSTYPE = "fuse.blockcache"  # what fsclient's mounts show in the mount table
# Errors a FUSE mount point answers once its connection is gone.
DEAD_MOUNT_ERRNOS = {errno.ENOTCONN, errno.ECONNABORTED}


class MountError(BlockcacheError):
    """The mount point cannot be used, or mounting/unmounting failed."""


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo that matters here."""

    mountpoint: str
    fstype: str
    source: str
    device: int = 0  # its st_dev, known without searching its path


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal
    out, i = [], 0
    raw = field.encode("utf-8", "surrogateescape")
    while i < len(raw):
        if raw[i] == 0x5C and len(raw[i + 1:i + 4]) == 3 and raw[i + 1:i + 4].isdigit():
            out.append(int(raw[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return bytes(out).decode("utf-8", "surrogateescape")


def mounts() -> list[MountEntry]:
    """The current mount table of this process's mount namespace."""
    entries = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.decode("utf-8", "surrogateescape").rstrip("\n").split(" ")
            try:
                sep = fields.index("-")
            except ValueError:
                continue
            major, _, minor = fields[2].partition(":")
            entries.append(MountEntry(_unescape(fields[4]), fields[sep + 1],
                                      _unescape(fields[sep + 2]),
                                      os.makedev(int(major), int(minor))))
    return entries


def find_mount(path: str) -> MountEntry | None:
    """The topmost mount exactly at `path` (already made `absolute`), or None."""
    found = None
    for entry in mounts():
        if entry.mountpoint == path:
            found = entry
    return found


def absolute(path: str) -> str:
    """Absolute path with symlinks resolved in the parent only: the mount point
    itself may be a dead mount that cannot be stat'ed."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    return os.path.join(os.path.realpath(parent), name) if name else path


def probe(path: str, timeout: float = PROBE_TIMEOUT, call: Callable = os.stat) -> Any:
    """`call(path)` (os.stat) with a timeout; raises OSError as the call does, or
    MountError on timeout."""
    result: list = []

    def run() -> None:
        try:
            result.append(call(path))
        except OSError as exc:
            result.append(exc)

    t = threading.Thread(target=run, name="probe-mountpoint", daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        raise MountError(f"mount point {path} does not answer within {timeout:g}s (a FUSE "
                         f"process holding it is stuck); free it with "
                         f"`fsclient umount --lazy {path}`")
    if isinstance(result[0], OSError):
        raise result[0]
    return result[0]


def _fusermount() -> str:
    exe = shutil.which("fusermount3") or shutil.which("fusermount")
    if exe is None:
        raise MountError("fusermount3 not found; install the fuse3 package "
                         "(`apt-get install fuse3`, or run `make sysdeps`)")
    return exe


def unmount(path: str, lazy: bool = False) -> None:
    """Unmount a FUSE mount with fusermount3; MountError with the reason."""
    cmd = [_fusermount(), "-u"] + (["-z"] if lazy else []) + ["--", path]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise MountError(f"{' '.join(cmd)} did not finish within 30s") from None
    if res.returncode != 0:
        why = (res.stderr or res.stdout).strip() or f"exit code {res.returncode}"
        hint = ""
        if "busy" in why.lower():
            hint = (f"; close the files open under it (see `fuser -vm {path}`), or detach "
                    f"it now with `fsclient umount --lazy {path}`")
        raise MountError(f"cannot unmount {path}: {why}{hint}")


def await_orphan(path: str, warn: Callable[[str], None] | None = None,
                 timeout: float = ORPHAN_WAIT) -> None:
    """Wait for an fsclient mount on `path` (made `absolute`) whose keeper is gone
    to go dead. Its server still answers until it sees the keeper gone, and then
    ends the connection; the caller knows no keeper holds `path`. Returns at
    once for no fsclient mount, a dead one, or one stuck (`prepare` reports it)."""
    entry = find_mount(path)
    if entry is None or entry.fstype != FSTYPE:
        return
    deadline = time.monotonic() + timeout
    warned = False
    while True:
        left = deadline - time.monotonic()
        try:
            probe(path, timeout=max(left, 0.1), call=os.statvfs)
        except (OSError, MountError):  # dead now, or stuck
            return
        if left <= 0:
            return
        if not warned:
            (warn or log.warning)(f"{path} is mounted but its keeper is gone; waiting up to "
                                  f"{timeout:g}s for its server to end the mount")
            warned = True
        time.sleep(0.05)


def prepare(path: str, warn: Callable[[str], None] | None = None) -> str:
    """Check (and if needed recover) the mount point; return its `absolute` path.

    Raises MountError for a missing path, a non-directory, or a live mount.
    `warn` receives the message about a recovered dead mount (default: the log).
    """
    path = absolute(path)
    try:
        st = probe(path)
        entry = find_mount(path)
        if entry is not None and entry.fstype.startswith("fuse"):
            # stat may be answered from the kernel's attribute cache even when
            # the FUSE process is gone; statfs always goes to the process.
            probe(path, call=os.statvfs)
    except FileNotFoundError:
        raise MountError(f"mount point {path} does not exist; create it with "
                         f"`mkdir -p {path}`") from None
    except OSError as exc:
        if exc.errno not in DEAD_MOUNT_ERRNOS:
            raise MountError(f"cannot use mount point {path}: {exc.strerror}") from None
        entry = find_mount(path)
        (warn or log.warning)(f"mount point {path} holds a dead FUSE mount "
                              f"({entry.source if entry else 'unknown'}: {exc.strerror}; its "
                              f"process died); unmounting it lazily and mounting again")
        unmount(path, lazy=True)
        try:
            st = probe(path)
        except OSError as exc2:
            raise MountError(f"mount point {path} is still unusable after unmounting its dead "
                             f"mount: {exc2.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"mount point {path} is not a directory")
    entry = find_mount(path)
    if entry is not None:
        raise MountError(f"mount point {path} is busy: {entry.source} ({entry.fstype}) is "
                         f"already mounted there; unmount it first with "
                         f"`fsclient umount {path}`")
    return path


def is_mounted(path: str) -> bool:
    return find_mount(absolute(path)) is not None
