"""Blocks fetched ahead of the reads that will want them, on a small pool.

Consecutive missing blocks go in one request of up to a part of a window
(`options.PART_BYTES`), one job per part so parts arrive in parallel. Bounded: past
`PENDING_LIMIT` queued jobs new ones are dropped and counted. A sequential
reader's job is dropped (counted) if its run was cancelled before it sends a
request (`sequential.Stream.cancel`). Never blocks a reader, never raises
for I/O: the real read reports errors.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from ...common.counters import Counters
from ...sources.fileinfo import FileInfo
from ..hits.blockhits import HitReader
from ..misses.fetch import Fetcher
from ..options import part_blocks
from .sequential import Stream

log = logging.getLogger(__name__)

WORKERS = 4
PENDING_LIMIT = 256       # queued prefetch jobs before new ones are dropped


class Prefetcher:
    """Background fetches of one volume in one process."""

    def __init__(self, block_size: int, window: int, hits: HitReader, fetcher: Fetcher,
                 counters: Counters):
        self.block_size = block_size
        self.window = window
        self.part = part_blocks(block_size)
        self._hits = hits
        self._fetcher = fetcher
        self.counters = counters
        self._pool: ThreadPoolExecutor | None = None  # made at the first job
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when _pending drops to 0

    def windows(self, rel: str, info: FileInfo, prefix: str, offset: int, length: int) -> None:
        """Fetch the blocks of [offset, offset+length) in the background, one
        job per part of each window."""
        bs = self.block_size
        end = min(info.size, offset + length)
        step = self.window * bs
        boff = offset - offset % bs
        while boff < end:
            if not self.ahead(rel, info, prefix, boff, min(end, boff + step)):
                return
            boff += step

    def ahead(self, rel: str, info: FileInfo, prefix: str, start: int, end: int,
              stream: Stream | None = None) -> bool:
        """`run` in the background, a job per part (`options.PART_BYTES`) so
        parts arrive in parallel; dropped once `stream` is cancelled. False
        if a part was dropped."""
        epoch = stream.epoch if stream is not None else 0
        step = self.part * self.block_size
        for part in range(start, end, step):
            if not self.submit(self.run, rel, info, prefix, part, min(end, part + step), stream,
                               epoch):
                return False
        return True

    def run(self, rel: str, info: FileInfo, prefix: str, start: int, end: int,
            stream: Stream | None = None, epoch: int = 0) -> None:
        """Fetch the blocks of [start, end) (block-aligned `start`) that are
        neither in memory, cached nor being fetched: each run of consecutive
        missing ones with one request; none once `stream` has a new epoch."""
        bs = self.block_size
        boff = start
        mem = self._hits.mem
        try:
            while boff < end:
                key = prefix + format(boff, "016x")
                if stream is not None and stream.epoch != epoch:
                    self.counters.add("prefetches_cancelled")
                    return
                if (mem.get(key) is None and not self._fetcher.busy(key)
                        and not self._hits.is_cached(key)):
                    if self._fetcher.fetch(rel, info, key, boff,
                                           -(-(end - boff) // bs)) is not None:
                        self.counters.add("prefetches")  # (None: another reader's fill)
                boff += bs
        except Exception as exc:
            log.debug("prefetch of %s at %d failed: %s", rel, boff, exc)

    def submit(self, fn, *args) -> bool:
        """Run fn(*args) on the prefetch pool unless too much is queued already."""
        with self._lock:
            if self._pending >= PENDING_LIMIT:
                self.counters.add("prefetches_dropped")
                return False
            self._pending += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="blockcache-prefetch")
            pool = self._pool

        def run() -> None:
            try:
                fn(*args)
            finally:
                self._done()
        try:
            pool.submit(run)
        except RuntimeError:  # the volume is closing
            self._done()
            return False
        return True

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1
            if not self._pending:
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Until no job is queued or running (a job's fetch may wait for
        another reader's fill, then counts it): False if `timeout` passed."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
