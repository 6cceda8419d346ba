"""Rebuilding the index from disk: each cache dir is scanned in the
background at start (and after it comes back from being unhealthy), and
what the scan found is indexed a chunk per event-loop turn, oldest first,
each block's policy count restored from its mtime. Puts to a dir are
refused while it is scanned; evictions issued meanwhile are remembered
(`RebuildEvictions`) and applied to what the scan finds.

A mixin of `cache.Cache`: its methods use the cache's index, stores,
workers and health, and the eviction mixin's `_unlink` and `_trim`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from functools import partial

from .index import TIME_GRAIN
from .policy import decode_mtime_ns
from .scan import Placement, ScanResult

log = logging.getLogger(__name__)

# scanned entries indexed per event-loop turn; small, so the transient tuples
# of a chunk do not leave lasting heap behind
REBUILD_CHUNK = 5_000
# processes for the start-up scan of a big dir (it is CPU-bound Python)
SCAN_PROCESSES = max(1, min(4, os.cpu_count() or 1))
# single-key evictions remembered while a rebuild runs (~100 B each)
MAX_REBUILD_EVICTIONS = 200_000


class Rebuild:
    """The cache's rebuild from disk (see the module docstring)."""

    def _init_rebuild(self, n: int) -> None:
        # rebuild state per dir: True while its scan runs (puts to it are refused,
        # since its usage is not known yet)
        self.rebuilding = [True] * n
        self._scan_failed = [False] * n
        self._rebuild_evictions = RebuildEvictions()
        self.rebuild_stats = {"state": "running", "scanned": 0, "removed": 0, "indexed": 0,
                              "seconds": 0.0}
        self._rebuild_started = time.monotonic()

    def start_rebuild(self) -> None:
        """Scan every dir in the background; the socket serves meanwhile."""
        for i in range(len(self.stores)):
            self._start_scan(i)

    def _start_scan(self, i: int) -> None:
        self.rebuilding[i] = True
        self.rebuild_stats["state"] = "running"
        placement = None
        if len(self.stores) > 1:
            placement = tuple((d.path, d.placement_weight) for d in self.cfg.cache_dirs)
        # untimed: a long scan is not a hung disk
        self.workers[i].submit(self._scan_job, i, placement, done=partial(self._scanned, i),
                               timed=False)

    def _scan_job(self, i: int, placement: Placement | None) -> ScanResult:
        store = self.stores[i]
        store.prepare()
        cleared = store.clear_tmp()
        result = store.scan(placement, i, SCAN_PROCESSES)
        result.removed += cleared
        return result

    def _scanned(self, i: int, result: ScanResult | None, exc: BaseException | None) -> None:
        if exc is not None:
            log.error("cache dir %s: rebuild scan failed: %s", self.paths[i], exc)
            self._scan_failed[i] = True
            if self.health.mark_unhealthy(i, f"rebuild scan failed: {exc}"):
                self._health_changed()
            self._rebuild_done(i)
            return
        assert result is not None
        self._scan_failed[i] = False
        self.rebuild_stats["scanned"] += result.scanned
        self.rebuild_stats["removed"] += result.removed
        self._index_scanned(i, result.oldest_first())

    def _index_scanned(self, i: int, entries: Iterator[tuple[int, str, int]]) -> None:
        """Index one chunk of scan results (oldest first), then yield the loop."""
        chunk = [self._restored(ns, key, size)
                 for ns, key, size in itertools.islice(entries, REBUILD_CHUNK)]
        more = len(chunk) == REBUILD_CHUNK  # before evictions shorten it
        if self._rebuild_evictions:
            evicted = self._rebuild_evictions.matching([e[1] for e in chunk])
            if evicted:
                gone = set(evicted)
                chunk = [e for e in chunk if e[1] not in gone]
                self._unlink(i, evicted)
        self.rebuild_stats["indexed"] += self.index.add_many(i, chunk)
        if more:
            self._loop.call_soon(self._index_scanned, i, entries)
            return
        if self.policy is not None:
            self.policy.fit(len(self.index))
        log.info("cache dir %s: rebuilt %d entries (%d bytes)", self.paths[i],
                 len(self.index.dirs[i]), self.index.dirs[i].used_bytes)
        self._rebuild_done(i)
        self._space_due[i] = 0.0
        self._trim(i)

    def _restored(self, mtime_ns: int, key: str, size: int) -> tuple[int, str, int]:
        """A scanned block as `Index.add_many` takes it, its count restored
        from its mtime's nanoseconds (see `policy`): 0 if it was demoted, 1
        if none was written (it was put)."""
        seconds, count = decode_mtime_ns(mtime_ns)
        return (seconds & -TIME_GRAIN) | (1 if count is None else count), key, size

    def _rebuild_done(self, i: int) -> None:
        self.rebuilding[i] = False
        if not any(self.rebuilding):
            self._rebuild_evictions.clear()
            self.rebuild_stats["state"] = "done"
            self.rebuild_stats["seconds"] = round(time.monotonic() - self._rebuild_started, 3)


class RebuildEvictions:
    """Evictions issued while a dir is still being scanned, applied to what
    the scan finds. Each scanned entry costs O(1) whatever their number: a
    set of keys, a set of `vol_` / `vol_inode_` prefixes (looked up by the
    entry's own two prefixes), and one flag for "everything": a list of
    matchers tried on every entry would cost evicts x entries, seconds of
    a blocked loop for thousands of evicts during a large rebuild.

    Bounded: past `MAX_REBUILD_EVICTIONS` keys, further ones are not
    remembered (logged once); such a block comes back with the scan, and its
    reader evicts it again if it still fails authentication."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.prefixes: set[str] = set()
        self.everything = False
        self.forgotten = 0

    def __bool__(self) -> bool:
        return self.everything or bool(self.keys) or bool(self.prefixes)

    def add_key(self, key: str) -> None:
        if len(self.keys) < MAX_REBUILD_EVICTIONS:
            self.keys.add(key)
            return
        if not self.forgotten:
            log.warning("more than %d single-key evictions during the rebuild: further ones "
                        "are not applied to the scan's results", MAX_REBUILD_EVICTIONS)
        self.forgotten += 1

    def add_prefix(self, prefix: str | None) -> None:
        if prefix is None:
            self.everything = True
        else:
            self.prefixes.add(prefix)  # one per volume/inode evicted: admin or bounded by keys

    def matching(self, keys: list[str]) -> list[str]:
        """Those of `keys` an eviction issued during the rebuild covers."""
        if self.everything:
            return keys
        out = []
        evicted, prefixes = self.keys, self.prefixes
        for key in keys:
            if key in evicted:
                out.append(key)
            elif prefixes:
                vol_end = key.index("_") + 1
                if key[:vol_end] in prefixes or key[:key.index("_", vol_end) + 1] in prefixes:
                    out.append(key)
        return out

    def clear(self) -> None:
        self.keys.clear()
        self.prefixes.clear()
        self.everything = False
        self.forgotten = 0
