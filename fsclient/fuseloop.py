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
"""

from __future__ import annotations

import select
from typing import Any, Callable

import pyfuse3.asyncio

# Shortcut waits in a row before one goes through the loop.
FAST_STREAK = 8

_installed: Callable[..., Any] | None = None


def install() -> None:
    """Wrap pyfuse3's asyncio `wait_readable` (idempotent; process-wide)."""
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
    _installed = wait_readable
