"""The fetching of a warmup: every uncached block of the files, a bounded
number at a time, without outrunning the daemon's fill queue; and the
summary of what it did."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from blockcache_client.contract.errors import BlockcacheError
from blockcache_client.contract.units import format_size
from blockcache_client.sources.fileinfo import FileInfo

from .interrupts import Interrupted
from .progress import Tally
from .shard import Shard
from .targets import Target, reason, resolved, walk

DRAIN_TIMEOUT = 30.0       # seconds to hand in-flight fills to the daemon at the end
FILL_HIGH = 0.5            # fraction of the reader's fill queue above which fetches wait


class Warmup:
    """Fetch every uncached block of the targets, `parallel` at a time; with a
    `shard`, only of the files that are that shard's."""

    def __init__(self, volume: Any, parallel: int, fill_queue_bytes: int,
                 shard: Shard | None = None):
        self.volume = volume
        self.parallel = parallel
        self.shard = shard
        self.fill_limit = int(fill_queue_bytes * FILL_HIGH)
        self.tally = Tally()
        self.interrupted: str | None = None
        self._slots = threading.BoundedSemaphore(2 * parallel)
        self._stats_pool = ThreadPoolExecutor(parallel, thread_name_prefix="warmup-stat")
        self._fetch_pool = ThreadPoolExecutor(parallel, thread_name_prefix="warmup-fetch")

    def run(self, items: Iterable[Target]) -> None:
        t = self.tally
        try:
            for target, info in resolved(self.volume, self._stats_pool, items, 2 * self.parallel):
                if info is None:
                    t.fail(target.given, target.error or "unknown error")
                    continue
                try:
                    for f in walk(self.volume, info, lambda d, exc: t.fail(d, reason(exc)),
                                  self._stats_pool, on_link=self._link):
                        if self.shard is None or self.shard.owns(f.path):
                            self._file(f)
                        else:
                            self._other_shard(f)
                except (OSError, BlockcacheError) as exc:
                    t.fail(target.given, reason(exc))
            t.listed_all = True
        except Interrupted as exc:
            self.interrupted = str(exc)
            # a second Ctrl-C (or SIGTERM) while in-flight work drains ends the process at once
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        finally:
            self._stats_pool.shutdown(wait=False, cancel_futures=True)
            self._finish()

    def _link(self, info: FileInfo) -> None:
        with self.tally.lock:
            self.tally.skipped_links += 1

    def _other_shard(self, info: FileInfo) -> None:
        with self.tally.lock:
            self.tally.other_shard_files += 1
            self.tally.other_shard_bytes += info.size

    def _file(self, info: FileInfo) -> None:
        t = self.tally
        with t.lock:
            t.files += 1
            t.bytes += info.size
        for off, length, cached in self.volume.block_map(info.path, info):
            if cached:
                with t.lock:
                    t.cached_bytes += length
                    t.cached_blocks += 1
                continue
            self._wait_fill_room()
            while not self._slots.acquire(timeout=0.5):
                pass
            fut = self._fetch_pool.submit(self._fetch, info, off, length)
            fut.add_done_callback(lambda _: self._slots.release())

    def _wait_fill_room(self) -> None:
        """The reader drops fills when its queue is full: don't outrun the daemon."""
        while self.volume.stats()["fill_queue_bytes"] > self.fill_limit:
            time.sleep(0.01)

    def _fetch(self, info: FileInfo, off: int, length: int) -> None:
        t = self.tally
        try:
            self.volume.read(info.path, off, length, info)
        except Exception as exc:  # one bad file must not stop the others
            with t.lock:
                t.failed_bytes += length
            t.fail(info.path, reason(exc))
            return
        with t.lock:
            t.fetched_bytes += length

    def _finish(self) -> None:
        """Let in-flight fetches end and hand their fills to the daemon."""
        self._fetch_pool.shutdown(wait=True)
        if not self.volume.wait_fills(DRAIN_TIMEOUT):
            self.tally.fail("(fill queue)", f"fills not all handed to blockcached within "
                                            f"{DRAIN_TIMEOUT:g}s; run warmup again")


def summary(w: Warmup, elapsed: float, stats: dict[str, Any]) -> str:
    """The end-of-run report."""
    t = w.tally
    state = f"interrupted ({w.interrupted})" if w.interrupted else "done"
    if w.shard is not None:
        state = f"of shard {w.shard} {state}"
    # What came from the source, by the reader's own counts: a read of a
    # file's first block fetches the blocks after it in the same request
    # (coalesced), so an interrupted run may have fetched (and handed over)
    # blocks its own reads had not reached yet. Every block fetched is
    # offered to the daemon once: sent, or dropped and counted.
    fetched_bytes = stats["backend_bytes"]
    fetched_blocks = stats["fills_sent"] + stats["fills_dropped"]
    rate = fetched_bytes / elapsed if elapsed > 0 else 0.0
    lines = [
        f"warmup {state} in {elapsed:.1f}s: {t.files} files, {format_size(t.bytes)}",
        f"  already cached  {format_size(t.cached_bytes)} ({t.cached_blocks} blocks)",
        f"  fetched         {format_size(fetched_bytes)} ({fetched_blocks} blocks, "
        f"{format_size(rate)}/s; {stats.get('backend_requests', 0)} source requests)",
        f"  failed          {t.failed_count} path{'s' if t.failed_count != 1 else ''}"
        + (f", {format_size(t.failed_bytes)}" if t.failed_bytes else ""),
    ]
    if stats.get("fills_dropped"):
        lines.append(f"  fills dropped   {stats['fills_dropped']} (fetched but not cached: "
                     f"blockcached was unreachable or full; run warmup again)")
    if w.shard is not None:
        lines.append(f"  other shards    {t.other_shard_files} files, "
                     f"{format_size(t.other_shard_bytes)} (the other hosts' share)")
    if t.skipped_links:
        lines.append(f"  links skipped   {t.skipped_links}")
    for path, why in t.failures.items():
        lines.append(f"    {path}: {why}")
    if t.failed_count > len(t.failures):
        lines.append(f"    ... and {t.failed_count - len(t.failures)} more")
    return "\n".join(lines)
