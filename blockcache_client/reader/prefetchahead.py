"""`prefetch_ahead`: read a cold epoch ahead, in the order the job already knows.

A `DataLoader`'s sampler runs in the main process and knows the whole
epoch's order; its workers read file by file, and each miss waits a round
trip to the remote. Wrapping the sampler (or any iterable of paths) in
`prefetch_ahead` keeps up to `depth` files ahead of the consumer being put
into the host cache (`hostfill`), so the workers, in other processes, through
`Volume` or a FUSE mount of the same volume (same name, key, block size and
socket), hit.

Promises:
- Each item is yielded in order once its file is in the host cache (or its
  fill failed or was dropped: the reader then misses, still correct), so
  the worker that gets it hits.
- Bounded: at most `depth` files are in flight (hence at most `depth` source
  requests), and at most `max_bytes` of their blocks are held at once.
  Nothing runs ahead of the consumer by more than `depth` items: a consumer
  that stops leaves at most `depth` more files fetched, and `close()` (or
  dropping the iterator) cancels what has not started and stops the rest
  between blocks.
- Blocks already cached cost no source request (checked through the layout).
  The file's version comes from the volume's metadata cache (one listing per
  directory, then nothing until `meta_ttl`).
- A path that cannot be fetched (deleted, unreadable, changed mid-read) is
  logged and counted, and yielded like the others: the worker's own read
  raises the real error. So is one whose fetch is still running after the
  backend's whole retry budget (`HostFill.patience`: a hung source): the
  consumer never waits longer for one file. Only misuse raises here (an
  item that is not a path without `path_of`).
- Without a daemon there is nothing to fill: items pass straight through.
- No thread runs before the first `next()`, so creating it before the
  DataLoader forks its workers is safe.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..common.counters import Counters
from .ahead.hostfill import ByteBudget, Cancelled
from .volume import Volume

log = logging.getLogger(__name__)

DEFAULT_DEPTH = 64
DEFAULT_MAX_BYTES = 256 << 20
# what `PrefetchAhead.stats()` counts: files taken from the items, and per
# file yielded: its blocks were all cached already, are now, some were not
# taken (dropped), its fetch failed, or no daemon was there to fill
AHEAD_COUNTERS = ("files", "cached", "filled", "dropped", "failed", "no_daemon")


def prefetch_ahead(volume: Volume, items: Iterable[Any], depth: int = DEFAULT_DEPTH,
                   max_bytes: int = DEFAULT_MAX_BYTES, *,
                   path_of: Callable[[Any], str] | None = None) -> PrefetchAhead:
    """Yield `items` in order, each once the file it names is in the host cache,
    fetching up to `depth` files ahead, holding at most `max_bytes` of blocks.

    Items are volume paths, or anything `path_of(item)` maps to one (a
    sampler's indices: `prefetch_ahead(volume, sampler, path_of=ds.path_of)`
    yields the indices). See the module doc for what it promises.
    """
    if not isinstance(volume, Volume):
        raise TypeError(f"prefetch_ahead: volume must be a blockcache_client.Volume, not "
                        f"{type(volume).__name__}")
    for what, v in (("depth", depth), ("max_bytes", max_bytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"prefetch_ahead: {what} must be a positive integer, not {v!r}")
    if path_of is not None and not callable(path_of):
        raise TypeError(f"prefetch_ahead: path_of must map an item to its path (a callable), "
                        f"not {type(path_of).__name__}")
    return PrefetchAhead(volume, iter(items), depth, max_bytes, path_of)


class _Run:
    """The work of one `PrefetchAhead`: threads, budget and fill. Holds no
    reference to the iterator, so dropping the iterator closes this."""

    def __init__(self, volume: Volume, depth: int, max_bytes: int):
        self.volume = volume
        self.cancelled = threading.Event()
        self.budget = ByteBudget(max_bytes)
        self.fill = volume.host_fill(self.budget, self.cancelled)
        self.counts = Counters(AHEAD_COUNTERS)
        self.pool = ThreadPoolExecutor(depth, thread_name_prefix="blockcache-ahead")
        self._lock = threading.Lock()
        self._active = 0

    def submit(self, path: str) -> Future:
        return self.pool.submit(self._job, path)

    def settle(self, path: str, fut: Future) -> None:
        """On the consumer's thread, when `path`'s turn comes: wait for its
        fill (up to `patience`), see its blocks at their paths, count it."""
        try:
            outcome, keys = fut.result(timeout=self.fill.patience)
        except TimeoutError:
            log.info("prefetch_ahead: %s not fetched within %g s", path, self.fill.patience)
            outcome, keys = "failed", []
        if keys and not self.fill.written(keys):
            outcome = "dropped"
        self.counts.add(outcome)

    def _job(self, path: str) -> tuple[str, list[str]]:
        with self._lock:
            if self.cancelled.is_set():
                return "dropped", []
            self._active += 1
        try:
            return self._fill(path)
        finally:
            with self._lock:
                self._active -= 1
                last = self.cancelled.is_set() and not self._active
            if last:
                self.fill.close()

    def _fill(self, path: str) -> tuple[str, list[str]]:
        """What became of one file (the name of its counter), and the keys
        whose writes are still to be seen (`HostFill.fill`)."""
        if not self.fill.connected:
            return "no_daemon", []
        try:
            info = self.volume.stat(path)
            if info.is_dir:
                raise IsADirectoryError(f"{path} is a directory in volume {self.volume.name}")
            return self.fill.fill(info)
        except Cancelled:
            return "dropped", []
        except Exception as exc:  # the worker's own read raises it where it matters
            log.info("prefetch_ahead: %s not fetched: %s", path, exc)
            return "failed", []

    def close(self) -> None:
        with self._lock:
            self.cancelled.set()
            idle = not self._active
        self.pool.shutdown(wait=False, cancel_futures=True)
        if idle:
            self.fill.close()


class PrefetchAhead(Iterator):
    """The iterator `prefetch_ahead` returns; `close()` it (or use it as a
    context manager) to stop early; `stats()` says what it did."""

    def __init__(self, volume: Volume, items: Iterator[Any], depth: int, max_bytes: int,
                 path_of: Callable[[Any], str] | None):
        self.volume = volume
        self.depth = depth
        self.max_bytes = max_bytes
        self._items: Iterator[Any] | None = items
        self._path_of = path_of
        # (item, its path, its fill) for each item ahead of the consumer
        self._window: collections.deque[tuple[Any, str, Future | None]] = collections.deque()
        self._run: _Run | None = None  # made at the first next(): no threads before
        self._closed = False

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        if self._run is None:
            self._run = _Run(self.volume, self.depth, self.max_bytes)
            weakref.finalize(self, self._run.close)
        self._top_up()
        if not self._window:
            self.close()
            raise StopIteration
        item, path, fut = self._window.popleft()
        if fut is not None:
            self._run.settle(path, fut)
        return item

    def _top_up(self) -> None:
        """Start files until `depth` are ahead of the consumer (or items end)."""
        while self._items is not None and len(self._window) < self.depth:
            try:
                item = next(self._items)
            except StopIteration:
                self._items = None
                return
            fut = None
            try:
                path = item if self._path_of is None else self._path_of(item)
            except Exception as exc:  # the dataset's own lookup will raise it again
                log.info("prefetch_ahead: no path for item %r: %s", item, exc)
                self._run.counts.add("failed")
                path = ""
            else:
                if not isinstance(path, str):
                    self.close()
                    raise TypeError(self._not_a_path(item, path))
                fut = self._run.submit(path)
            self._run.counts.add("files")
            self._window.append((item, path, fut))

    def _not_a_path(self, item: Any, path: Any) -> str:
        if self._path_of is None:
            return (f"prefetch_ahead: item {item!r} ({type(item).__name__}) is not a volume "
                    f"path; pass path_of= to map each item (a sampler's index) to its path")
        return (f"prefetch_ahead: path_of({item!r}) returned {path!r} "
                f"({type(path).__name__}), not a volume path (str)")

    def close(self) -> None:
        """Stop: files not started are not fetched, those in flight stop
        between blocks. Idempotent."""
        self._closed = True
        self._items = None
        self._window.clear()
        if self._run is not None:
            self._run.close()

    def __enter__(self) -> PrefetchAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Files taken, and those yielded by what became of them
        (`AHEAD_COUNTERS`), the most source requests in flight at once
        (`max_requests`) and the most block bytes held (`peak_bytes`)."""
        run = self._run
        if run is None:
            return {**dict.fromkeys(AHEAD_COUNTERS, 0), "max_requests": 0, "peak_bytes": 0}
        return {**run.counts.snapshot(), "max_requests": run.fill.max_reading,
                "peak_bytes": run.budget.peak}
