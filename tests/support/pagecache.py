"""Evict files' pages from the kernel's page cache, as memory pressure would,
and make sure they are gone.

POSIX_FADV_DONTNEED is advice: a page that is locked or under I/O at that
moment (another process reading it, a writeback) stays. A test that needs the
next read to reach the disk checks with mincore(2), and asks again until the
pages are gone. (A probe by RWF_NOWAIT read would not do: a read that misses
starts readahead, and brings the pages back.)
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(fd: int) -> int:
    """How many of the file's pages are in memory."""
    return sum(resident_map(fd))


def resident_map(fd: int) -> list[bool]:
    """Whether each of the file's pages is in memory: mincore on a mapping of
    it, which faults nothing in."""
    size = os.fstat(fd).st_size
    if size == 0:
        return []
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr == _MAP_FAILED:
        raise OSError(ctypes.get_errno(), "mmap")
    try:
        vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        if _libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return [bool(b & 1) for b in vec.raw]
    finally:
        _libc.munmap(addr, size)


def drop_pages(path: str, timeout: float = 5.0) -> None:
    """Evict `path`'s pages; AssertionError if the kernel keeps any of them for
    `timeout` seconds."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages would stay: the daemon does not fsync blocks
        deadline = time.monotonic() + timeout
        while True:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if resident_pages(fd) == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the kernel keeps {path}'s pages in memory")
            time.sleep(0.01)
    finally:
        os.close(fd)


# why a test of RWF_NOWAIT's deferral is skipped (`nowait_read_defers` False)
UNDEFERRED = ("every RWF_NOWAIT read of dropped pages completed instead of deferring "
              "(a disk that answers at once, or a thread preempted while it did)")


def nowait_read_defers(path: str, tries: int = 50) -> bool:
    """Whether a RWF_NOWAIT read of `path`'s dropped pages is ever answered
    EAGAIN here. A read that misses starts the disk read, and answers EAGAIN
    only if it is still running when the kernel checks the page: a disk that
    completes it at once (a virtual disk served from its host's memory), or a
    busy machine that preempts the reading thread in between, may never defer
    one. Leaves the pages dropped."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(mmap.PAGESIZE)
        for _ in range(tries):
            drop_pages(path)
            try:
                os.preadv(fd, [buf], 0, os.RWF_NOWAIT)
            except BlockingIOError:
                drop_pages(path)  # (the read started readahead)
                return True
        drop_pages(path)
        return False
    finally:
        os.close(fd)


def drop_tree_pages(dirs) -> int:
    """Evict the pages of every file under `dirs`; the number of files."""
    n = 0
    for top in dirs:
        for dirpath, _, files in os.walk(top):
            for name in files:
                drop_pages(os.path.join(dirpath, name))
                n += 1
    return n


def random_fd(path: str) -> int:
    """A descriptor whose reads are one page each (no readahead), none cached."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd
