"""A cheaper wait for the next FUSE request in pyfuse3's asyncio mode.

pyfuse3's workers wait for /dev/fuse with `pyfuse3.asyncio.wait_readable`,
which registers the fd with the loop's epoll, creates a future and a done
callback, lets the loop run one iteration, then unregisters the fd: two
epoll_ctl calls, one epoll_wait and a handful of Python objects per request,
even when the next request is already queued (the common case under load: a
reader's lookup, open, read and release arrive back to back). `install`
wraps it: one `poll(fd, 0)` first, and when a request is already waiting the
worker reads it at once. Only one worker waits at a time (pyfuse3 holds its
read lock around the wait), so nothing else can take the request between the
poll and the read.

Fairness: a worker whose requests keep arriving would otherwise never yield
to the loop (pool results, background listings, the metrics server), so at
most `FAST_STREAK` waits in a row take the shortcut; the next one goes through
the stock wait, which runs one loop iteration. Anything but plain POLLIN
(an error or hang-up as the mount goes away) also takes the stock path, which
handles unmount and close exactly as before.

The read lock: pyfuse3 keeps one more worker waiting for the read lock than
is reading, so a handler that awaits the pool never stops request intake.
With asyncio's fair Lock, a worker that answered a request inline and comes
back for the next one must queue behind that idle worker: one loop round trip
and two task switches per request just to pass the lock along. `BargingLock`
lets the worker coming back take a free lock at once; the waiter it passed is
woken once and waits again, and it gets the lock whenever the reading worker
awaits something (a pool read) or stops. Nothing depends on the order in which
pyfuse3's identical workers read.
"""

from __future__ import annotations

import asyncio
import collections
import select
from collections.abc import Callable
from typing import Any

import pyfuse3.asyncio

# Shortcut waits in a row before one goes through the loop.
FAST_STREAK = 8

_installed: Callable[..., Any] | None = None


class BargingLock:
    """An asyncio lock that a free-lock acquire takes at once, even ahead of
    waiters (asyncio.Lock is FIFO-fair: its acquire yields to them first).
    A release wakes the first waiter not yet woken; a woken waiter that finds
    the lock taken again waits again; a woken waiter that is cancelled passes
    its wake-up on, so a free lock never strands a waiter."""

    __slots__ = ("_locked", "_waiters")

    def __init__(self) -> None:
        self._locked = False
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def locked(self) -> bool:
        return self._locked

    async def acquire(self) -> bool:
        while self._locked:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled() and not self._locked:
                    self._wake()  # woken, then cancelled: the next waiter takes it
                raise
            finally:
                self._waiters.remove(fut)
        self._locked = True
        return True

    def release(self) -> None:
        if not self._locked:
            raise RuntimeError("BargingLock.release: the lock is not held")
        self._locked = False
        self._wake()

    def _wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(True)
                return

    async def __aenter__(self) -> None:
        if not self._locked:  # the usual case (once per request): no acquire coroutine
            self._locked = True
            return
        await self.acquire()

    async def __aexit__(self, *exc: Any) -> None:
        self.release()


def install() -> None:
    """Wrap pyfuse3's asyncio `wait_readable` and give its workers' read lock
    the BargingLock (idempotent; process-wide; before `pyfuse3.main`, which
    makes the lock at its first wait)."""
    global _installed
    if _installed is not None:
        return
    stock = pyfuse3.asyncio.wait_readable
    polls: dict[int, Any] = {}
    streak = 0

    async def wait_readable(fd: Any) -> None:
        nonlocal streak
        if streak < FAST_STREAK:
            p = polls.get(fd)
            if p is None:
                p = polls[fd] = select.poll()
                p.register(fd, select.POLLIN)
            ready = p.poll(0)
            if ready and ready[0][1] == select.POLLIN:
                streak += 1
                return
        streak = 0
        await stock(fd)

    pyfuse3.asyncio.wait_readable = wait_readable
    pyfuse3.asyncio.Lock = BargingLock
    _installed = wait_readable
