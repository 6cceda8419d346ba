"""Opening paths inside a cache tree without following symlinks.

The cache tree is the daemon's; anything in it that is not a plain dir or a
plain file (a symlink to /etc, a FIFO) must not make the daemon write or
delete outside it, nor make a reader open something else or block. Linux's
openat2(2) resolves a whole path under these rules in one call (Python has
no wrapper; the raw syscall goes through ctypes, as `nowait` does):

- RESOLVE_BENEATH: the path may not leave the directory it is relative to;
- RESOLVE_NO_SYMLINKS: no component may be a symlink (ELOOP);
- RESOLVE_CACHED (see `nowait`): every component from the dentry cache.

Where openat2 is missing (before Linux 5.6, an architecture whose syscall
number is not known here) `open_beneath` walks the path one component at a
time with O_NOFOLLOW, which refuses the same symlinks at the cost of a
syscall per component.

Readers' blocking hit path does not come here: through ctypes an open costs
several microseconds more than `os.open`, on every hit. It opens with
O_NOFOLLOW | O_NONBLOCK and checks with fstat that it got a regular file of
the daemon's uid, which is what a symlinked dir in the tree could otherwise
change (`volume.Volume._read_cached`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

__all__ = ["SUPPORTED", "Unsupported", "openat2", "open_beneath", "open_dir",
           "RESOLVE_BENEATH", "RESOLVE_NO_SYMLINKS", "RESOLVE_NO_MAGICLINKS", "RESOLVE_CACHED"]

# openat2 has one number on every architecture whose table was unified (5.1+)
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437}.get(platform.machine())
AT_FDCWD = -100
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_CACHED = 0x20
# the errnos that say "this kernel or file system cannot do it", never "not now"
_UNSUPPORTED = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.E2BIG})
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_PATH_DIR = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Unsupported(OSError):
    """The kernel or file system cannot resolve the path this way."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def _load_syscall():
    if not sys.platform.startswith("linux") or _SYS_OPENAT2 is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    # every argument a full register: a variadic call must not leave the
    # upper half of `size` undefined
    fn.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_char_p, ctypes.c_void_p,
                   ctypes.c_size_t]
    return fn


_syscall = _load_syscall()
SUPPORTED = _syscall is not None
# the kernel only reads this struct, so one per (flags, mode, resolve) is shared
_how_cache: dict[tuple[int, int, int], _OpenHow] = {}
_refused = [False]  # openat2 answered ENOSYS once: walk components from then on


def openat2(path: str | bytes, flags: int, resolve: int, dir_fd: int = AT_FDCWD,
            mode: int = 0) -> int:
    """openat2(2): an fd, OSError (FileNotFoundError, ...) as open(2) gives
    them, ELOOP for a symlink the rules refuse, `Unsupported` where the call
    or one of the `resolve` flags is not known to the kernel."""
    if _syscall is None or _refused[0]:
        raise Unsupported(errno.ENOSYS, "openat2 is not available here")
    how = _how_cache.get((flags, mode, resolve))
    if how is None:
        how = _how_cache[(flags, mode, resolve)] = _OpenHow(flags, mode, resolve)
    fd = _syscall(_SYS_OPENAT2, dir_fd, path if isinstance(path, bytes) else os.fsencode(path),
                  ctypes.addressof(how), ctypes.sizeof(how))
    if fd < 0:
        code = ctypes.get_errno()
        if code == errno.ENOSYS:
            _refused[0] = True
        raise (Unsupported if code in _UNSUPPORTED else OSError)(code, os.strerror(code),
                                                                 os.fsdecode(path))
    return fd


def open_beneath(dir_fd: int, rel: str, flags: int, mode: int = 0) -> int:
    """Open `rel` (no "..", not absolute) under the dir `dir_fd` without
    following a symlink in any component: ELOOP (or ENOTDIR) where one is."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return openat2(rel, flags, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
                       dir_fd, mode)
    except Unsupported:
        pass
    *parents, last = rel.split("/")
    fd = dir_fd
    try:
        for name in parents:
            if name in ("", ".", ".."):
                raise OSError(errno.EXDEV, f"{rel} does not stay beneath its dir", rel)
            nxt = os.open(name, _PATH_DIR, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = nxt
        return os.open(last, flags, mode, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def open_dir(path: str) -> int:
    """A readable fd of the directory at `path` (following the path as given:
    the configured root of a tree is the administrator's choice)."""
    return os.open(path, _DIR)
