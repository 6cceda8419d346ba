"""The cache engine: ties the index, the stores, capacity, health and the
fill queue together. Everything here runs on the event loop and never blocks:
disk work goes to each dir's `DirWorker`, results come back as callbacks.

See DESIGN.md for the invariants and crash cases.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from blockcache_client.contract.blockkey import key_prefix
from blockcache_client.contract.layout import CacheDir, Layout

from .capacity import DirCapacity
from .config import Config
from .daemonarea import AreaSpan
from .filler import DirWorker, FillQueue
from .health import Health
from .index import COUNT_MASK, TIME_GRAIN, Index
from .policy import Policy, decode_mtime_ns, encode_mtime_ns
from .store import Placement, ScanResult, Store, TreeMoved

log = logging.getLogger(__name__)

TOUCH_PERSIST_AFTER = 60     # seconds: renew a block's mtime at most this often
MAX_PENDING_UTIMES = 200_000  # per dir; beyond this, recency persists less precisely
SPACE_INTERVAL = 1.0          # seconds between statvfs of a dir
# scanned entries indexed per event-loop turn; small, so the transient tuples
# of a chunk do not leave lasting heap behind
REBUILD_CHUNK = 5_000
IO_BATCH = 2_000              # unlinks / mtime updates per worker job
# processes for the start-up scan of a big dir (it is CPU-bound Python)
SCAN_PROCESSES = max(1, min(4, os.cpu_count() or 1))
# single-key evictions remembered while a rebuild runs (~100 B each)
MAX_REBUILD_EVICTIONS = 200_000
AGING_CHUNK = 20_000          # cached blocks whose counts one tick halves (the policy's aging)


class Cache:
    """The cache state machine behind the protocol handlers."""

    def __init__(self, cfg: Config, loop: asyncio.AbstractEventLoop):
        self.cfg = cfg
        self._loop = loop
        n = len(cfg.cache_dirs)
        self.paths = [d.path for d in cfg.cache_dirs]
        self.stores = [Store(p) for p in self.paths]
        self.index = Index(n)
        self.health = Health(self.paths)
        self.caps = [DirCapacity(d.size, cfg.high_watermark, cfg.low_watermark,
                                 cfg.min_free_bytes, cfg.min_free_inodes) for d in cfg.cache_dirs]
        self.fill = FillQueue(cfg.fill_queue_bytes, cfg.fill_queue_share)
        self.workers = [DirWorker(str(i), loop) for i in range(n)]
        self.layout = self._make_layout()
        # rebuild state per dir: True while its scan runs (puts to it are refused,
        # since its usage is not known yet)
        self.rebuilding = [True] * n
        self._scan_failed = [False] * n
        self._rebuild_evictions = RebuildEvictions()
        self.rebuild_stats = {"state": "running", "scanned": 0, "removed": 0, "indexed": 0,
                              "seconds": 0.0}
        self._rebuild_started = time.monotonic()
        self._utimes: list[dict[str, int]] = [{} for _ in range(n)]
        self._space_due = [0.0] * n
        self._space_pending = [False] * n
        self._probe_pending = [False] * n
        self._checking: set[str] = set()  # keys whose file presence is being checked
        self.counters = dict(hits=0, misses=0, puts=0, put_bytes=0, writes=0, write_bytes=0,
                             write_errors=0, evictions=0, evicted_bytes=0, touches=0,
                             touch_bytes=0)
        self.put_reasons: dict[str, int] = {}
        # which blocks a full dir keeps; None = plain LRU (admit every block)
        self.policy = Policy(self.index, self.counters) if cfg.admission_policy != "lru" else None
        self.evicted_by: dict[str, int] = {}  # eviction reason -> blocks
        self.quotas = dict(cfg.volume_quotas)  # volume -> max bytes over all dirs
        self._vol_reserved: dict[str, int] = {}  # volume -> bytes of admitted, unwritten puts
        self._aged = 0  # sketch halvings whose aging of the cached blocks' counts has started
        self._aging: list[tuple[int, list[str]]] = []  # (dir, keys) still to halve
        # per volume: [touches, touch_bytes, puts, put_bytes]. Readers find hits
        # through the layout and report them by touch, and put a block after a
        # miss, so touches and puts are the reader hits and misses the daemon
        # truthfully sees (bytes are block-file sizes on both sides).
        self.volume_counters: dict[str, list[int]] = {}

    # -- layout ------------------------------------------------------------

    def _make_layout(self) -> Layout:
        return Layout([CacheDir(d.path, d.placement_weight, self.health.healthy[i])
                       for i, d in enumerate(self.cfg.cache_dirs)])

    @property
    def epoch(self) -> int:
        return self.health.epoch

    def _health_changed(self) -> None:
        self.layout = self._make_layout()

    # -- start / rebuild ---------------------------------------------------

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
        from its mtime's nanoseconds (see `policy`): at least 1, it was put."""
        seconds, count = decode_mtime_ns(mtime_ns)
        return (seconds & -TIME_GRAIN) | max(1, count), key, size

    def _rebuild_done(self, i: int) -> None:
        self.rebuilding[i] = False
        if not any(self.rebuilding):
            self._rebuild_evictions.clear()
            self.rebuild_stats["state"] = "done"
            self.rebuild_stats["seconds"] = round(time.monotonic() - self._rebuild_started, 3)

    # -- lookups and touches ------------------------------------------------

    def lookup(self, keys: list[str]) -> list[str | None]:
        """Path of each key's block file, None for a miss. Keys must be parsed."""
        now = int(time.time())
        out: list[str | None] = []
        healthy = self.health.healthy
        hits = 0
        for key in keys:
            i, stale = self.index.touch(key, now, TOUCH_PERSIST_AFTER)
            if i >= 0 and healthy[i]:
                out.append(self.stores[i].block_path(key))
                hits += 1
                if stale:
                    self._note_utime(i, key, now)
            else:
                out.append(None)
        self.counters["hits"] += hits
        self.counters["misses"] += len(keys) - hits
        return out

    def touch(self, keys: list[str]) -> int:
        now = int(time.time())
        n = 0
        nbytes = 0
        dirs = self.index.dirs
        per_volume: dict[str, list[int]] = {}
        for key in keys:
            i, stale = self.index.touch(key, now, TOUCH_PERSIST_AFTER)
            if i >= 0:
                n += 1
                size = dirs[i].lru[key] >> 32
                nbytes += size
                c = per_volume.setdefault(key[:key.index("_")], [0, 0])
                c[0] += 1
                c[1] += size
                if stale:
                    self._note_utime(i, key, now)
        self.counters["touches"] += n
        self.counters["touch_bytes"] += nbytes
        for vol, (count, size) in per_volume.items():
            c = self._volume_counter(vol)
            if c is not None:
                c[0] += count
                c[1] += size
        return n

    def _volume_counter(self, vol: str) -> list[int] | None:
        c = self.volume_counters.get(vol)
        if c is None:
            if len(self.volume_counters) >= self.cfg.max_volumes:
                self._forget_gone_volumes()
            if len(self.volume_counters) < self.cfg.max_volumes:
                c = self.volume_counters[vol] = [0, 0, 0, 0]
        return c

    def _volume_known(self, vol: str) -> bool:
        """Whether a put may bring volume `vol` in: it is cached or counted
        already, or fewer than `max_volumes` are counted (the counter of a
        volume no longer cached gives way). Per-volume state (counters,
        stats, metric labels) is thus bounded whatever names clients choose."""
        counted = self.volume_counters
        if vol in counted or vol in self.index.volumes:
            return True
        if len(counted) >= self.cfg.max_volumes:
            self._forget_gone_volumes()
        return len(counted) < self.cfg.max_volumes

    def _forget_gone_volumes(self) -> None:
        """Drop the counters of volumes no longer cached nor being written,
        to make room (only when at `max_volumes`: the queue is scanned)."""
        live = self.index.volumes.keys() | {k[:k.index("_")] for k in self.fill.pending}
        gone = [v for v in self.volume_counters if v not in live]
        for v in gone:
            del self.volume_counters[v]

    def _note_utime(self, i: int, key: str, now: int) -> None:
        pending = self._utimes[i]
        if len(pending) < MAX_PENDING_UTIMES:
            # the mtime in ns: its nanoseconds carry the block's access count
            pending[key] = encode_mtime_ns(now, self.index.dirs[i].lru[key] & COUNT_MASK)

    # -- puts --------------------------------------------------------------

    def finish_writes(self) -> None:
        """Account for the writes done since the last request (see `DirWorker`'s lazy jobs)."""
        for w in self.workers:
            w.drain()

    def put(self, key: str, data: bytes | memoryview | AreaSpan,
            owner: int | None = None) -> tuple[bool, str]:
        """Admit a validated block for background writing; (accepted, reason).
        `owner` (the peer's uid) is held to its share of the fill queue. An
        accepted `AreaSpan` (a fill area's slot) is released on the dir's
        worker once its write no longer reads it; one not accepted is the
        caller's to release."""
        size = len(data)
        self.counters["puts"] += 1
        self.counters["put_bytes"] += size
        reason = self._admit(key, size, owner)
        self.put_reasons[reason] = self.put_reasons.get(reason, 0) + 1
        if reason != "too_many_volumes":
            # counted after admission: a refused new volume name leaves no state
            c = self._volume_counter(key[:key.index("_")])
            if c is not None:
                c[2] += 1
                c[3] += size
        if reason != "queued":
            return False, reason
        i = self.layout.dir_index(key)
        self.caps[i].reserve(size)
        if self.quotas:
            vol = key[:key.index("_")]
            self._vol_reserved[vol] = self._vol_reserved.get(vol, 0) + size
        write = self.stores[i].write
        if isinstance(data, AreaSpan):
            write = partial(_releasing, write)
        self.workers[i].submit(write, key, data, done=partial(self._written, i, key, size),
                               lazy=True)
        return True, reason

    def _admit(self, key: str, size: int, owner: int | None) -> str:
        i = self.layout.dir_index(key)
        if not self.health.healthy[i]:
            return "unhealthy"
        if self.rebuilding[i]:
            return "rebuilding"
        if key in self.index:
            self.index.touch(key, int(time.time()), TOUCH_PERSIST_AFTER)
            self._check_present(i, key)
            return "exists"
        if size > self.caps[i].capacity:
            return "too_large"
        if not self._volume_known(key[:key.index("_")]):
            return "too_many_volumes"
        reason = self.fill.offer(key, size, owner)
        if reason is not None:
            return reason
        reason = self._make_room(i, key, size)
        if reason != "queued":
            self.fill.finish(key)
        return reason

    def _check_present(self, i: int, key: str) -> None:
        """A put of an indexed key means a reader missed it: check, on the
        dir's worker, that its file is still there. A file lost behind our
        back (deleted or renamed by a person, fsck or a failing disk) would
        otherwise stay indexed, every refill of it answer `exists`, and every
        read of it go to the remote until LRU happened to evict it."""
        if key in self._checking:
            return
        self._checking.add(key)
        self.workers[i].submit(self.stores[i].exists, key,
                               done=partial(self._checked, key))

    def _checked(self, key: str, present: Any, exc: BaseException | None) -> None:
        # FIFO per dir: a write or unlink of this key queued after the check
        # reports after it, so an indexed key missing at check time is lost
        self._checking.discard(key)
        if exc is not None or present or key not in self.index:
            return
        hit = self.index.remove(key)
        if hit is not None:
            log.warning("cache dir %s: block %s vanished from disk; dropped from the index so "
                        "it is filled again", self.paths[hit[0]], key)
            self._count_evictions("vanished", 1, hit[1])

    def _reserved_entries(self) -> int:
        return sum(c.reserved_entries for c in self.caps)

    def _make_room(self, i: int, key: str, size: int) -> str:
        """Evict what admitting `key` needs, if the policy admits it over
        those blocks: "queued", "not_admitted" or "no_space"."""
        cap, d = self.caps[i], self.index.dirs[i]
        need_bytes = cap.need_bytes(d.used_bytes, size)
        need_entries = cap.need_entries(len(d))
        own = self._quota_victims(i, key, size) if self.quotas else []
        if own is None:
            return "over_quota"
        policy = self.policy
        if need_bytes or need_entries or own:
            victims = self._dir_victims(i, own, need_bytes, need_entries)
            if policy is not None:
                before = policy.miss(key)
                counts = [self.index.count_of(k) for _, k, _ in own]
                counts += [self.index.count_of(k) for k, _ in victims]
                if policy.admit(before, counts) is None:
                    return "not_admitted"
                self.fill.pending[key].count = before + 1
            for j in sorted({j for j, _, _ in own}):
                self._evict(j, [(k, s) for jj, k, s in own if jj == j], "quota")
            self._evict(i, victims, "admission")
        max_entries = self.cfg.max_entries
        if max_entries:
            after = len(self.index) + self._reserved_entries() + 1
            if after > self.cfg.high_watermark * max_entries:
                self._evict_entries(i, after - int(self.cfg.low_watermark * max_entries))
            if len(self.index) + self._reserved_entries() + 1 > max_entries:
                return "no_space"
        return "queued" if cap.fits(d.used_bytes, len(d), size) else "no_space"

    def _dir_victims(self, i: int, own: list[tuple[int, str, int]], need_bytes: int,
                     need_entries: int) -> list[tuple[str, int]]:
        """The least recently used blocks of dir `i` that make room for a
        put, besides `own` (its volume's blocks leaving for its quota, which
        make room here too when they are in this dir)."""
        if not own:
            return self.index.peek_lru(i, need_bytes, need_entries)
        mine = {k for j, k, _ in own if j == i}
        freed = sum(s for j, _, s in own if j == i)
        need_bytes = max(0, need_bytes - freed)
        need_entries = max(0, need_entries - len(mine))
        victims = [v for v in self.index.peek_lru(i, need_bytes + freed, need_entries + len(mine))
                   if v[0] not in mine]
        return _enough(victims, need_bytes, need_entries)

    def _quota_victims(self, i: int, key: str, size: int) -> list[tuple[int, str, int]] | None:
        """(dir, key, size) of the blocks of `key`'s volume that must leave for
        it to stay within its quota, least recently used first, this dir's
        first; [] if it is within, None if even all of them would not do."""
        vol = key[:key.index("_")]
        quota = self.quotas.get(vol)
        if quota is None:
            return []
        if size > quota:
            return None
        used = self.index.volumes.get(vol, (0, 0))[1]
        over = used + self._vol_reserved.get(vol, 0) + size - quota
        out: list[tuple[int, str, int]] = []
        for j in [i] + [j for j in range(len(self.stores)) if j != i]:
            if over <= 0:
                break
            for k, s in self.index.peek_lru(j, over, volume=vol):
                out.append((j, k, s))
                over -= s
        return out if over <= 0 else None

    def _evict_entries(self, i: int, count: int) -> None:
        """Evict `count` LRU entries for max_entries: this dir first, then the
        fullest others."""
        order = [i] + sorted((j for j in range(len(self.stores)) if j != i),
                             key=lambda j: -len(self.index.dirs[j]))
        for j in order:
            if count <= 0:
                break
            oldest = self.index.peek_lru(j, 0, min(count, len(self.index.dirs[j])))
            count -= len(self._evict(j, oldest, "max_entries"))

    def _written(self, i: int, key: str, size: int, _: Any, exc: BaseException | None) -> None:
        pending = self.fill.finish(key)
        self.caps[i].release(size)
        if self.quotas:
            vol = key[:key.index("_")]
            left = self._vol_reserved.get(vol, 0) - size
            if left > 0:
                self._vol_reserved[vol] = left
            else:
                self._vol_reserved.pop(vol, None)
        if exc is not None:
            self.counters["write_errors"] += 1
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                log.warning("cache dir %s is full (%s); refreshing free space", self.paths[i], exc)
                self._space_due[i] = 0.0
            elif self.health.error(i, exc):
                self._health_changed()
            return
        self.health.ok(i)
        if pending.cancelled:
            self._unlink(i, [key])
            return
        now = int(time.time())
        count = pending.count  # the policy's, at admission (1 under plain LRU)
        self.index.add(key, i, size, now, count)
        if count > 1:
            self._note_utime(i, key, now)  # admitted on its count: keep it across a restart
        self.counters["writes"] += 1
        self.counters["write_bytes"] += size
        # Admission evicts only indexed blocks, so with many puts in flight a
        # dir can end above its high watermark (never its limit) once they
        # land; trim it now, not at the next statvfs tick, so a dir at rest
        # is below its high watermark and a restart indexes what it left.
        self._trim(i)

    # -- evictions ---------------------------------------------------------

    def _unlink(self, i: int, keys: list[str]) -> None:
        if not keys:
            return
        utimes = self._utimes[i]
        for k in keys:
            utimes.pop(k, None)
        store = self.stores[i]
        # in bounded jobs: one huge job would look like a hung disk
        for start in range(0, len(keys), IO_BATCH):
            self.workers[i].submit(_unlink_all, store, keys[start:start + IO_BATCH])

    def _evict(self, i: int, victims: list[tuple[str, int]], reason: str) -> list[tuple[str, int]]:
        """Evict `victims` (key, size) of dir `i`, counted under `reason`."""
        if victims:
            policy = self.policy
            for key, _ in victims:
                if policy is not None:
                    policy.evicted(key, self.index.count_of(key))
                self.index.remove(key)
            self._count_evictions(reason, len(victims), sum(s for _, s in victims))
            log.debug("cache dir %s: evicted %d blocks (%s)", self.paths[i], len(victims), reason)
            self._unlink(i, [k for k, _ in victims])
        return victims

    def _count_evictions(self, reason: str, n: int, nbytes: int) -> None:
        self.counters["evictions"] += n
        self.counters["evicted_bytes"] += nbytes
        self.evicted_by[reason] = self.evicted_by.get(reason, 0) + n

    def evict_key(self, key: str) -> int:
        self.fill.cancel_key(key)
        if any(self.rebuilding):
            self._rebuild_evictions.add_key(key)
        hit = self.index.remove(key)
        if hit is None:
            return 0
        self._unlink(hit[0], [key])
        return 1

    def evict_prefix(self, volume: str | None, inode: int | None = None) -> int:
        """Evict a volume, one inode of it, or everything (volume None)."""
        prefix = None if volume is None else key_prefix(volume, inode)
        match = _always if prefix is None else (lambda k: k.startswith(prefix))
        self.fill.cancel(match)
        if any(self.rebuilding):
            self._rebuild_evictions.add_prefix(prefix)
        removed = self.index.remove_range(prefix)
        per_dir: dict[int, list[str]] = {}
        for i, key in removed:
            per_dir.setdefault(i, []).append(key)
        for i, keys in per_dir.items():
            self._unlink(i, keys)
        return len(removed)

    def list_keys(self, volume: str | None, limit: int,
                  after: str | None = None) -> tuple[list[str], bool]:
        """Up to `limit` keys in order (of one volume or all), after `after`;
        and whether more follow."""
        prefix = None if volume is None else key_prefix(volume)
        keys = list(self.index.range(prefix, limit + 1, after))
        return keys[:limit], len(keys) > limit

    # -- upkeep ------------------------------------------------------------

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

    def _trim(self, i: int) -> None:
        """Evict down to the low watermark if a dir is above its high one
        (the free-space floor moved, or a rebuild found more than fits)."""
        cap, d = self.caps[i], self.index.dirs[i]
        need_bytes = cap.trim_bytes(d.used_bytes)
        need_entries = cap.need_entries(len(d), 0)
        if need_bytes or need_entries:
            self._evict(i, self.index.peek_lru(i, need_bytes, need_entries), "trim")
        for vol, quota in self.quotas.items():  # a quota lowered since the blocks came in
            over = self.index.volumes.get(vol, (0, 0))[1] + self._vol_reserved.get(vol, 0) - quota
            if over > 0:
                self._evict(i, self.index.peek_lru(i, over, volume=vol), "quota")
        max_entries = self.cfg.max_entries
        if max_entries and len(self.index) > max_entries:
            self._evict_entries(i, len(self.index) - int(self.cfg.low_watermark * max_entries))

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for queued puts to be written."""
        deadline = time.monotonic() + timeout
        while self.fill.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.fill.pending

    def close(self) -> None:
        for w in self.workers:
            w.stop()

    # -- stats -------------------------------------------------------------

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


class RebuildEvictions:
    """Evictions issued while a dir is still being scanned, applied to what
    the scan finds. Each scanned entry costs O(1) whatever their number: a
    set of keys, a set of `vol_` / `vol_inode_` prefixes (looked up by the
    entry's own two prefixes), and one flag for "everything". A list of
    matchers, each tried on every entry, let 5,000 evicts during a
    20,000-entry rebuild block the loop for 1.66 s at a time.

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


def _enough(victims: list[tuple[str, int]], free_bytes: int,
            free_entries: int) -> list[tuple[str, int]]:
    """The shortest prefix of `victims` that frees `free_bytes` and `free_entries`."""
    out, freed = [], 0
    for v in victims:
        if freed >= free_bytes and len(out) >= free_entries:
            break
        out.append(v)
        freed += v[1]
    return out


def _always(_: str) -> bool:
    return True


def _unlink_all(store: Store, keys: list[str]) -> None:
    for key in keys:
        store.unlink(key)


def _releasing(write: Callable[[str, AreaSpan], None], key: str, span: AreaSpan) -> None:
    """`write`, then free the span's slot however it ended (on the dir's
    worker: the reader waiting for the slot needs no wake-up of the loop)."""
    try:
        write(key, span)
    finally:
        span.release()
