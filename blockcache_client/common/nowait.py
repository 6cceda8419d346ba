"""Opening and reading cache files only when the kernel can answer from memory.

A FUSE worker serves a cache hit on its own thread, without handing its
channel to another one first (`blocking`), only if doing so can never block
on the cache disk: a slow or hung disk must not freeze the mount. Linux
says so exactly:

- `open_cached(path)`: openat2(2) with RESOLVE_CACHED resolves every path
  component from the dentry cache or fails with EAGAIN (BlockingIOError)
  where a lookup would need I/O (the syscall itself is in `safeopen`);
- `os.preadv(fd, bufs, off, os.RWF_NOWAIT)`: reads only pages already in the
  page cache; EAGAIN, or a short count, where some are not.

`SUPPORTED` is False where openat2 is not available (not Linux, an
architecture whose syscall number is not known here, or a kernel before
5.12): callers then take their blocking path on a thread, as before.
A kernel or file system that refuses either call at run time (ENOSYS,
EOPNOTSUPP, EINVAL) raises `Unsupported`, so the caller can stop trying.
"""

from __future__ import annotations

import os

from . import safeopen
from .safeopen import Unsupported

__all__ = ["SUPPORTED", "Unsupported", "open_cached"]

SUPPORTED = safeopen.SUPPORTED and hasattr(os, "RWF_NOWAIT")


def open_cached(path: str, flags: int) -> int:
    """An fd for `path` opened with `flags`, only if every path component is
    in the dentry cache. BlockingIOError when the lookup would need I/O,
    FileNotFoundError and other OSErrors as open(2) gives them,
    `Unsupported` where openat2/RESOLVE_CACHED is refused."""
    return safeopen.openat2(path, flags, safeopen.RESOLVE_CACHED)
