"""Background writing: one worker thread per cache dir, and the fill queue.

`DirWorker` runs every blocking operation on one cache dir (writes, unlinks,
statvfs, probes, mtime updates, the rebuild scan) in FIFO order on its own
thread, so a hung disk stalls only its own dir: the event loop never touches
the disk, and the other dirs keep going. FIFO order is what keeps the hard
size limit true on disk too: the unlinks of the blocks evicted to make room
for a put are queued before that put's write.

A finished job's `done` runs on the loop in submission order. A put's write
is submitted `lazy`: its end does not wake the loop (a wake-up per put cost
more than the bookkeeping it runs); the next request, the next eager job or
a timer runs it, within `LAZY_DELAY`.

`FillQueue` bounds the bytes of puts accepted but not yet written, in all
and per peer uid (`fill_queue_share` of it). A put over either bound is
dropped and counted (fills are best effort: the reader already has its
bytes). A key already queued is not queued again. It counts each volume's
queued puts too (a volume with some keeps its slot).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

Done = Callable[[Any, BaseException | None], None]
LAZY_DELAY = 0.02  # seconds: the latest a lazy job's `done` runs once it finished


class DirWorker:
    """A thread running blocking jobs for one cache dir, in submission order."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop):
        self.name = name
        self._loop = loop
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_since = 0.0  # time.monotonic() when the running job started; 0 = idle
        self.backlog = 0       # jobs submitted and not finished (read on the loop)
        self._lazy_out = 0     # lazy jobs submitted and not finished: the timer runs while > 0
        # (done, result, exc, lazy) of finished jobs, in submission order
        self._finished: collections.deque = collections.deque()
        self._lazy_timer: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._run, name=f"dir-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, done: Done | None = None,
               timed: bool = True, lazy: bool = False) -> None:
        """Run `fn(*args)` on the worker; then `done(result, exc)` on the loop.
        Untimed jobs (the rebuild scan) are never reported as hung. A lazy
        job's `done` does not wake the loop: it runs at the next `drain`
        (the daemon drains before each request it answers), after the next
        eager job, or within `LAZY_DELAY`, always in submission order."""
        self.backlog += 1
        self._q.put((fn, args, done, timed, lazy))
        if lazy:
            self._lazy_out += 1
            if self._lazy_timer is None:
                self._lazy_timer = self._loop.call_later(LAZY_DELAY, self._lazy_due)

    def drain(self) -> None:
        """Run the `done` of every finished job, in submission order (on the
        loop, at a point where no other callback is half done)."""
        finished = self._finished
        while finished:
            done, result, exc, lazy = finished.popleft()
            self._lazy_out -= lazy
            self._finish(done, result, exc)

    def _lazy_due(self) -> None:
        self._lazy_timer = None
        self.drain()
        # only lazy jobs need the timer: an eager one wakes the loop itself
        # (a long rebuild scan must not keep it ticking every LAZY_DELAY)
        if self._lazy_out:
            self._lazy_timer = self._loop.call_later(LAZY_DELAY, self._lazy_due)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, args, done, timed, lazy = job
            self.busy_since = time.monotonic() if timed else 0.0
            try:
                result, exc = fn(*args), None
            except BaseException as e:  # reported to the loop, never kills the worker
                result, exc = None, e
            self.busy_since = 0.0
            # drop the arguments now, not when the next job comes: a put's
            # block is a view of a frame buffer the server reuses once free
            job = fn = args = None
            self._finished.append((done, result, exc, lazy))
            done = result = exc = None
            if lazy:
                continue
            try:
                self._loop.call_soon_threadsafe(self.drain)
            except RuntimeError:  # loop closed: the daemon is exiting
                return

    def _finish(self, done: Done | None, result: Any, exc: BaseException | None) -> None:
        self.backlog -= 1
        if done is not None:
            # drain runs inside an unrelated request's handling: a bug in one
            # job's bookkeeping must cost that job, not that request or the
            # jobs queued behind it
            try:
                done(result, exc)
            except Exception:
                log.exception("dir %s: a background job's bookkeeping failed", self.name)
        elif exc is not None:
            log.warning("dir %s: background job failed: %s", self.name, exc)

    def stuck_for(self, now: float) -> float:
        """Seconds the running job has been running (0 if idle)."""
        since = self.busy_since
        return now - since if since else 0.0

    def stop(self) -> None:
        self._q.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@dataclass(slots=True)
class Pending:
    size: int
    owner: int | None = None  # uid of the peer that put it (None: held to no share)
    volume: str = ""  # the key's volume (its queued puts are counted)
    cancelled: bool = False  # evicted while queued: delete instead of indexing
    count: int = 1  # accesses the block is indexed with (the policy's count at admission)


class FillQueue:
    """Accounting for puts accepted but not yet written, bounded in bytes,
    and per owner (peer uid) bounded to `share` of that, so one client's
    puts cannot keep everyone else's fills out."""

    def __init__(self, limit_bytes: int, share: float = 1.0):
        self.limit = limit_bytes
        self.owner_limit = max(1, int(limit_bytes * share))
        self.queued_bytes = 0
        self.pending: dict[str, Pending] = {}
        self.owned: dict[int | None, int] = {}  # owner -> bytes queued (owners with some only)
        self.volumes: dict[str, int] = {}  # volume -> puts queued (volumes with some only)
        self.drops = 0
        self.over_share = 0
        self.duplicates = 0

    def offer(self, key: str, size: int, owner: int | None = None,
              volume: str | None = None) -> str | None:
        """Queue `key` (of `volume`, the part before its first "_", given if
        known), or return why not ("duplicate", "over_share", "queue_full")."""
        if key in self.pending:
            self.duplicates += 1
            return "duplicate"
        held = self.owned.get(owner, 0)
        if held and owner is not None and held + size > self.owner_limit:
            self.over_share += 1
            return "over_share"
        if self.queued_bytes + size > self.limit:
            self.drops += 1
            return "queue_full"
        vol = key[:key.index("_")] if volume is None else volume
        self.pending[key] = Pending(size, owner, vol)
        self.queued_bytes += size
        self.owned[owner] = held + size
        self.volumes[vol] = self.volumes.get(vol, 0) + 1
        return None

    def finish(self, key: str) -> Pending:
        p = self.pending.pop(key)
        self.queued_bytes -= p.size
        left = self.owned[p.owner] - p.size
        if left:
            self.owned[p.owner] = left
        else:
            del self.owned[p.owner]
        queued = self.volumes[p.volume] - 1
        if queued:
            self.volumes[p.volume] = queued
        else:
            del self.volumes[p.volume]
        return p

    def cancel(self, match: Callable[[str], bool]) -> int:
        """Mark queued keys matching `match` as evicted; returns how many."""
        n = 0
        for key, p in self.pending.items():
            if not p.cancelled and match(key):
                p.cancelled = True
                n += 1
        return n

    def cancel_key(self, key: str) -> bool:
        """Mark one queued key as evicted (O(1): a reader's evict-by-key)."""
        p = self.pending.get(key)
        if p is None or p.cancelled:
            return False
        p.cancelled = True
        return True

    def __len__(self) -> int:
        return len(self.pending)
