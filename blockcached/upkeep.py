"""Upkeep on the event loop's tick: worker timeouts and health probes,
free space, persisting recency (block mtimes, whose nanoseconds carry the
policy's count), aging the cached blocks' counts after the policy's sketch
halves, and the stats the daemon reports.

A mixin of `cache.Cache`: its methods use the cache's index, health,
caps, stores, workers and counters, and the rebuild's `_start_scan`.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from .eviction import IO_BATCH
from .index import COUNT_MASK, TIME_MASK
from .policy import encode_mtime_ns
from .store import TreeMoved

log = logging.getLogger(__name__)

MAX_PENDING_UTIMES = 200_000  # per dir; beyond this, recency persists less precisely
SPACE_INTERVAL = 1.0          # seconds between statvfs of a dir
AGING_CHUNK = 20_000          # cached blocks whose counts one tick halves (the policy's aging)


class Upkeep:
    """The cache's periodic work and stats (see the module docstring)."""

    def _init_upkeep(self, n: int) -> None:
        self._utimes: list[dict[str, int]] = [{} for _ in range(n)]  # mtimes (ns) to persist
        self._space_due = [0.0] * n
        self._space_pending = [False] * n
        self._probe_pending = [False] * n
        self._aged = 0  # sketch halvings whose aging of the cached blocks' counts has started
        self._aging: list[tuple[int, list[str]]] = []  # (dir, keys) still to halve

    def tick(self) -> None:
        """Periodic upkeep, from the event loop: timeouts, free space, probes,
        persisting recency."""
        now = time.monotonic()
        for i, worker in enumerate(self.workers):
            stuck = worker.stuck_for(now)
            if stuck > self.cfg.io_timeout and self.health.timeout(i, stuck):
                self._health_changed()
            if self.health.probe_due(i, now) and not self._probe_pending[i]:
                self._probe_pending[i] = True
                worker.submit(self.stores[i].probe, done=partial(self._probed, i))
            if not self.health.healthy[i] or worker.backlog > 1000:
                continue
            if now >= self._space_due[i] and not self._space_pending[i]:
                self._space_pending[i] = True
                self._space_due[i] = now + SPACE_INTERVAL
                worker.submit(self.stores[i].space, done=partial(self._spaced, i))
            if self._utimes[i]:
                batch, self._utimes[i] = list(self._utimes[i].items()), {}
                for start in range(0, len(batch), IO_BATCH):
                    worker.submit(self.stores[i].touch_times, batch[start:start + IO_BATCH])
        self.age_counts()

    def age_counts(self) -> None:
        """After the policy's sketch halved, halve the cached blocks' counts
        too, a chunk per tick (a pass over millions would stall the loop)."""
        policy = self.policy
        if policy is None:
            return
        if not self._aging and policy.ages > self._aged:
            self._aged = policy.ages
            self._aging = [(i, list(d.lru)) for i, d in enumerate(self.index.dirs) if len(d)]
        if self._aging:
            i, keys = self._aging[-1]
            self.index.halve_counts(i, keys[-AGING_CHUNK:])
            del keys[-AGING_CHUNK:]
            if not keys:
                self._aging.pop()

    def _probed(self, i: int, _: Any, exc: BaseException | None) -> None:
        self._probe_pending[i] = False
        if self.health.probe_result(i, exc):
            self._health_changed()
            self._space_due[i] = 0.0
            # While it was out the dir may have lost files (or be a new disk):
            # forget its entries and rebuild them from what is really there.
            dropped = self.index.clear_dir(i)
            self._utimes[i].clear()
            log.info("cache dir %s: rescanning (%d entries dropped from the index)",
                     self.paths[i], dropped)
            self._start_scan(i)

    def _spaced(self, i: int, space: Any, exc: BaseException | None) -> None:
        self._space_pending[i] = False
        if exc is not None:
            # a moved tree: the writes that succeed would reset an error streak
            changed = (self.health.mark_unhealthy(i, f"{exc}; reopening it")
                       if isinstance(exc, TreeMoved) else self.health.error(i, exc))
            if changed:
                self._health_changed()
            return
        d = self.index.dirs[i]
        self.caps[i].observe(d.used_bytes, len(d), space.free_bytes, space.free_inodes)
        self._trim(i)

    def _note_utime(self, i: int, key: str, now: int) -> None:
        pending = self._utimes[i]
        if len(pending) < MAX_PENDING_UTIMES:
            # the mtime in ns: its nanoseconds carry the block's access count
            pending[key] = encode_mtime_ns(now, self.index.dirs[i].lru[key] & COUNT_MASK)

    def _note_demoted(self, i: int, keys: list[str]) -> None:
        """Persist a demotion (the policy's stale rule): each block's mtime
        keeps its indexed touch time, so its LRU place, with a count of 0."""
        pending = self._utimes[i]
        lru = self.index.dirs[i].lru
        room = MAX_PENDING_UTIMES - len(pending)
        for key in keys[:max(0, room)]:
            pending[key] = encode_mtime_ns(lru[key] & TIME_MASK, 0)

    def stats(self) -> dict[str, Any]:
        dirs = []
        for i, path in enumerate(self.paths):
            d, cap = self.index.dirs[i], self.caps[i]
            dirs.append({
                "path": path, "used_bytes": d.used_bytes, "capacity_bytes": cap.capacity,
                "limit_bytes": cap.byte_limit(), "reserved_bytes": cap.reserved,
                "entries": len(d), "healthy": self.health.healthy[i],
                "unhealthy_reason": self.health.reason[i],
                "io_errors": self.health.error_total[i],
                "high_watermark": cap.high, "low_watermark": cap.low,
                "free_bytes": cap.free_bytes, "free_inodes": cap.free_inodes,
                "rebuilding": self.rebuilding[i], "queued_jobs": self.workers[i].backlog,
            })
        c = self.counters
        return {
            "entries": len(self.index),
            "used_bytes": self.index.used_bytes,
            "capacity_bytes": sum(cap.capacity for cap in self.caps),
            **c,
            "drops": self.fill.drops,
            "over_share": self.fill.over_share,
            "put_results": dict(self.put_reasons),
            "evictions_by_reason": dict(self.evicted_by),
            "policy": (self.policy.stats(self.put_reasons.get("queued", 0))
                       if self.policy is not None
                       else {"name": "lru", "stale": False, "admitted": {}, "rejected": {}}),
            "queue": {"entries": len(self.fill), "bytes": self.fill.queued_bytes,
                      "limit_bytes": self.fill.limit},
            "rebuild": dict(self.rebuild_stats),
            "layout_epoch": self.epoch,
            "dirs": dirs,
            "volumes": self._volume_stats(),
            "volume_slots": self.slots.stats(),
        }

    def _volume_stats(self) -> dict[str, dict[str, int]]:
        out = {}
        counted, indexed = self.volume_counters, self.index.volumes
        for v in sorted(indexed.keys() | counted.keys() | self.quotas.keys()):
            n, b = indexed.get(v, (0, 0))
            touches, touch_bytes, puts, put_bytes = counted.get(v, (0, 0, 0, 0))
            out[v] = {"entries": n, "used_bytes": b, "touches": touches,
                      "touch_bytes": touch_bytes, "puts": puts, "put_bytes": put_bytes,
                      "quota_bytes": self.quotas.get(v, 0)}
        return out
