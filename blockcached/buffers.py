"""Memory for large frame bodies: the byte budget that bounds how much of
them is read at once (`ByteBudget`), and the pool their buffers are reused
from (`FramePool`), emptied once large frames stop coming (`IdleTrimmedPool`).
Both run on the event loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from blockcache_client.common.bufferpool import unused as _unused

FRAME_POOL_BYTES = 128 << 20  # large-frame buffers kept for reuse (= server.READ_BUDGET)
FRAME_POOL_IDLE = 10.0        # seconds without a large frame before the pool is emptied
FRAME_CLASS = 64 << 10        # their sizes are rounded up to a multiple of this


class ByteBudget:
    """A non-blocking counting limit in bytes, with FIFO waiters.

    Each owner (a peer uid) may hold at most `share` bytes of it, and all
    owners together all but `reserved`: what exempt callers (owner None,
    the admins) may always use. So peers that take budget with frames they
    never finish keep a bounded part of it, and never an admin's fill out.
    A waiter past its own owner's share holds no one back; one past the
    owners' part holds back the owners behind it; any other holds back all
    behind it (FIFO).
    """

    def __init__(self, limit: int, share: int | None = None, reserved: int = 0):
        self.limit = limit
        self.share = limit if share is None else share
        self.reserved = reserved
        self.used = 0
        self.owned = 0  # of `used`, held by owners (not by exempt callers)
        self.held: dict[int, int] = {}
        self._waiters: deque[tuple[int, int | None, Callable[[], None]]] = deque()

    def over_share(self, n: int, owner: int | None) -> bool:
        """Whether `n` more bytes would take `owner` past its share."""
        return owner is not None and self.held.get(owner, 0) + n > self.share

    def _over_owned(self, n: int, owner: int | None) -> bool:
        return owner is not None and self.owned + n > self.limit - self.reserved

    def held_back(self, n: int, owner: int | None) -> bool:
        """Whether `n` more bytes for `owner` must wait for owners' releases."""
        return self.over_share(n, owner) or self._over_owned(n, owner)

    def try_acquire(self, n: int, owner: int | None = None) -> bool:
        if self.used + n > self.limit or self.over_share(n, owner) \
                or self._over_owned(n, owner):
            return False
        for m, o, _ in self._waiters:  # one it would overtake
            if not self.over_share(m, o) and (owner is not None or not self._over_owned(m, o)):
                return False
        self._take(n, owner)
        return True

    def wait(self, n: int, owner: int | None, wake: Callable[[], None]) -> None:
        """Call `wake()` once `n` bytes have been acquired for `owner`."""
        self._waiters.append((n, owner, wake))
        self._grant()

    def release(self, n: int, owner: int | None = None) -> None:
        self.used -= n
        if owner is not None:
            self.owned -= n
            left = self.held[owner] - n
            if left:
                self.held[owner] = left
            else:
                del self.held[owner]
        self._grant()

    def forget(self, wake: Callable[[], None]) -> None:
        self._waiters = deque(w for w in self._waiters if w[2] is not wake)

    def _take(self, n: int, owner: int | None) -> None:
        self.used += n
        if owner is not None:
            self.owned += n
            self.held[owner] = self.held.get(owner, 0) + n

    def _grant(self) -> None:
        waiting: deque[tuple[int, int | None, Callable[[], None]]] = deque()
        granted = []
        owners_wait = False  # an owner past the owners' part: those behind it wait too
        while self._waiters:
            n, owner, wake = self._waiters[0]
            if self.over_share(n, owner) or (owner is not None and (
                    owners_wait or self._over_owned(n, owner))):
                owners_wait = owners_wait or not self.over_share(n, owner)
                waiting.append(self._waiters.popleft())
                continue
            if self.used + n > self.limit:
                break
            self._waiters.popleft()
            self._take(n, owner)
            granted.append(wake)
        waiting.extend(self._waiters)
        self._waiters = waiting
        for wake in granted:  # (after: a wake may release, which grants again)
            wake()


class FramePool:
    """Buffers for large frame bodies, reused once nothing refers to them.

    A put's block is decoded as a view of its frame's buffer and written from
    it by a dir worker, so the buffer stays in use until that write is done.
    Allocating a fresh one per frame costs more than the transfer itself:
    big allocations are mmapped (`__main__` pins glibc's mmap threshold), so
    each 1 MiB frame faulted in 256 zeroed pages and was unmapped after its
    write. Buffers of up to `FRAME_POOL_BYTES` in all are kept instead and
    handed out again once no view of them is alive (a burst of puts outruns
    the disk by that much before it allocates afresh), and given back once
    no large frame came for `FRAME_POOL_IDLE` seconds. That is checked, not
    assumed: a bytearray with a live view cannot be resized, so `_unused`
    shrinks it by a byte and grows it back (O(1), no copy), and BufferError
    means a queued write (or anything else) still refers to it. A reused
    buffer is thus never one something still reads.
    """

    def __init__(self, limit: int = FRAME_POOL_BYTES):
        self.limit = limit
        self.buffers: list[bytearray] = []
        self.size = 0
        self.last_take = 0.0  # time.monotonic() of the last `take`
        # where the next `take` starts looking: writes end in about the order
        # their puts came, so the buffer after the last one taken is the one
        # most likely free (a scan from the start checked every busy one first)
        self._cursor = 0

    def trim(self) -> None:
        """Let go of every buffer nothing refers to (the others are kept, so
        the pool still knows they are in use)."""
        self.buffers = [b for b in self.buffers if not _unused(b)]
        self.size = sum(map(len, self.buffers))

    def take(self, n: int) -> bytearray:
        """A buffer of at least `n` bytes (at most `FRAME_CLASS` more) that
        nothing else refers to."""
        self.last_take = time.monotonic()
        want = -(-n // FRAME_CLASS) * FRAME_CLASS
        spare = None
        count = len(self.buffers)
        for step in range(count):
            i = (self._cursor + step) % count
            buf = self.buffers[i]
            if _unused(buf):
                if len(buf) == want:
                    self._cursor = i + 1
                    return buf
                spare = buf
        if spare is not None and self.size + want > self.limit:
            # make room: frames of another size are being sent now
            self.buffers.remove(spare)
            self.size -= len(spare)
        buf = bytearray(want)
        if self.size + want <= self.limit:
            self.buffers.append(buf)
            self.size += want
        return buf


class IdleTrimmedPool:
    """A `FramePool` that lets go of its buffers once no large frame came
    for `FRAME_POOL_IDLE` seconds (checked by a timer on `loop`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = FRAME_POOL_BYTES):
        self.loop = loop
        self.pool = FramePool(limit)
        self._trim_timer: asyncio.TimerHandle | None = None

    def take(self, n: int) -> bytearray:
        if self._trim_timer is None:
            self._trim_timer = self.loop.call_later(FRAME_POOL_IDLE, self._trim)
        return self.pool.take(n)

    def _trim(self) -> None:
        """Empty the pool once large frames have stopped coming."""
        self._trim_timer = None
        pool = self.pool
        if time.monotonic() - pool.last_take >= FRAME_POOL_IDLE:
            pool.trim()
        if pool.buffers:
            self._trim_timer = self.loop.call_later(FRAME_POOL_IDLE, self._trim)

    def close(self) -> None:
        if self._trim_timer is not None:
            self._trim_timer.cancel()
            self._trim_timer = None
