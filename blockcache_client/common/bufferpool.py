"""Buffers of one size reused once nothing refers to them: where cold blocks land.

Why: a cold multi-block read received each 4 MiB block into a new
bytearray and copied it into a new bytes object. Big allocations come
fresh from the kernel, and on a VM each first touch of a page is a fault:
filling fresh memory costs several times the copy itself (0.9 ms per MiB
here, against 0.15 ms into memory touched before). A block received into a
buffer used before touches no new page.

How a buffer's user is tracked: a block is handed on as a read-only
memoryview of its buffer (`BufferPool.fill`); the memory LRU, the fill
queue and any slice keep that view (or one derived from it) alive. While one
is, the bytearray cannot be resized, so `take` tries to (`unused`):
shrinking it by a byte and growing it back is O(1) and copies nothing, and
BufferError means someone still reads it (the daemon's `blockcached.buffers`
checks its frame buffers the same way). A buffer is never handed out while
a view of it lives.

Fresh buffers (`populate=True`): an anonymous mapping whose pages the
kernel allocates in one call (MAP_POPULATE), not a bytearray whose pages
fault in one by one as they are first written: the first buffers of a cold
read (up to `limit`, the LRU's worth and a window's) are fresh, and a
fault per 4 KiB on this VM cost more than the kernel zeroing the same
pages in one go (0.88 against 0.58 ms a MiB, the copy into it included).
A mapping with a live view cannot be resized either, so `unused` tells
for both.

Bounded: the pool keeps buffers of up to `limit` bytes in all (in use or
idle); a block that finds none free gets a buffer of its own, not kept.
`take` checks the longest-idle buffer first (blocks leave the LRU oldest
first), and gives up after `TRIES` in use.
"""

from __future__ import annotations

import collections
import mmap
import threading

from .aligned import PAGE, page_view

TRIES = 4  # buffers checked per take before a new one is made


def unused(buf: bytearray | mmap.mmap) -> bool:
    """True if no view of `buf` is alive (resizing it fails otherwise)."""
    try:
        if isinstance(buf, mmap.mmap):
            buf.resize(len(buf))  # the same size: nothing moves
            return True
        del buf[-1:]
    except BufferError:
        return False
    buf.append(0)
    return True


def populated(n: int) -> mmap.mmap:
    """`n` zero bytes whose pages are already there (see the module docstring)."""
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)


class BufferPool:
    """Reusable bytearrays of `size` bytes, at most `limit` bytes of them
    kept; thread-safe."""

    def __init__(self, size: int, limit: int, page_aligned: bool = False,
                 populate: bool = False):
        self.size = size
        self.limit = max(0, limit)
        self._populate = populate
        # views start on a page (`aligned.page_view`): each buffer is a page longer
        self._slack = PAGE if page_aligned else 0
        self._kept: collections.deque[bytearray | mmap.mmap] = collections.deque()
        self._lock = threading.Lock()
        self.reused = 0  # takes served by a buffer used before (tests, stats)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the buffers the pool keeps (in use or idle)."""
        return len(self._kept) * self.size

    def take(self) -> memoryview:
        """A view of a buffer of `size` bytes that nothing else refers to.
        The view is made under the lock: until it exists the buffer looks
        unused, and another thread's `take` could hand it out too."""
        with self._lock:
            kept = self._kept
            for _ in range(min(TRIES, len(kept))):
                buf = kept.popleft()
                kept.append(buf)  # in use or handed out now: last in line either way
                if unused(buf):
                    self.reused += 1
                    return self._view(buf)
            n = self.size + self._slack
            buf = populated(n) if self._populate else bytearray(n)
            if (len(kept) + 1) * self.size <= self.limit:
                kept.append(buf)
            return self._view(buf)

    def _view(self, buf: bytearray | mmap.mmap) -> memoryview:
        return page_view(buf, self.size) if self._slack else memoryview(buf)

    def fill(self, n: int, readinto) -> memoryview:
        """A read-only view of up to `n` (<= `size`) bytes that `readinto(view)`
        stored in a taken buffer (it returns how many: fewer only at the end
        of the data)."""
        view = self.take()[:n]
        got = readinto(view)
        if got < n:
            view = view[:got]
        return view.toreadonly()
