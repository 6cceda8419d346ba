"""Opening and reading cache files only when the kernel can answer from memory.

An event loop (the FUSE client's) may serve a cache hit itself, without a
thread hop, only if doing so can never block on the cache disk: a slow or
hung disk must not freeze the mount. Linux says so exactly:

- `open_cached(path)`: openat2(2) with RESOLVE_CACHED resolves every path
  component from the dentry cache or fails with EAGAIN (BlockingIOError)
  where a lookup would need I/O;
- `os.preadv(fd, bufs, off, os.RWF_NOWAIT)`: reads only pages already in the
  page cache; EAGAIN, or a short count, where some are not.

`SUPPORTED` is False where openat2 is not available (not Linux, an
architecture whose syscall number is not known here, or a kernel before
5.12): callers then take their blocking path on a thread, as before.
A kernel or file system that refuses either call at run time (ENOSYS,
EOPNOTSUPP, EINVAL) raises `Unsupported`, so the caller can stop trying.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

__all__ = ["SUPPORTED", "Unsupported", "open_cached"]

# openat2 has one number on every architecture whose table was unified (5.1+)
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437}.get(platform.machine())
_AT_FDCWD = -100
_RESOLVE_CACHED = 0x20
# the errnos that say "this kernel or file system cannot do it", never "not now"
_UNSUPPORTED = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.E2BIG})


class Unsupported(OSError):
    """The kernel or file system cannot open or read without blocking."""


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
SUPPORTED = _syscall is not None and hasattr(os, "RWF_NOWAIT")
_how_cache: dict[int, _OpenHow] = {}


def open_cached(path: str, flags: int) -> int:
    """An fd for `path` opened with `flags`, only if every path component is in
    the dentry cache. BlockingIOError when the lookup would need I/O,
    FileNotFoundError and other OSErrors as open(2) gives them, `Unsupported`
    where openat2/RESOLVE_CACHED is refused."""
    how = _how_cache.get(flags)
    if how is None:
        # the kernel only reads this struct, so one per flags value is shared
        how = _how_cache[flags] = _OpenHow(flags, 0, _RESOLVE_CACHED)
    if _syscall is None:
        raise Unsupported(errno.ENOSYS, "openat2 is not available here")
    fd = _syscall(_SYS_OPENAT2, _AT_FDCWD, os.fsencode(path), ctypes.addressof(how),
                  ctypes.sizeof(how))
    if fd < 0:
        code = ctypes.get_errno()
        cls = Unsupported if code in _UNSUPPORTED else OSError
        raise cls(code, os.strerror(code), path)
    return fd
