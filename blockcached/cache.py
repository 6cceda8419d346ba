"""The cache engine: ties the index, the stores, capacity, health and the
fill queue together. Everything here runs on the event loop and never blocks:
disk work goes to each dir's `DirWorker`, results come back as callbacks.

This module holds the operations the protocol handlers call (lookup,
touch, put, evict, list); the rebuild from disk (`rebuild`), victim choice
and quotas (`eviction`) and periodic upkeep and stats (`upkeep`) are mixins
of `Cache`. See DESIGN.md for the invariants and crash cases.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from blockcache_client.contract.blockkey import key_prefix
from blockcache_client.contract.layout import CacheDir, Layout

from .capacity import DirCapacity
from .config import Config
from .daemonarea import AreaSpan, SlotRewritten
from .eviction import Eviction
from .filler import DirWorker, FillQueue
from .health import Health
from .index import Index
from .policy import Policy
from .rebuild import Rebuild
from .store import Store
from .upkeep import Upkeep
from .volumeslots import VolumeSlots

log = logging.getLogger(__name__)

TOUCH_PERSIST_AFTER = 60     # seconds: renew a block's mtime at most this often


class Cache(Rebuild, Eviction, Upkeep):
    """The cache state machine behind the protocol handlers: lookups,
    touches, puts and evictions by key or prefix here; the rebuild, victim
    choice and upkeep in their mixins."""

    def __init__(self, cfg: Config, loop: asyncio.AbstractEventLoop):
        self.cfg = cfg
        self._loop = loop
        n = len(cfg.cache_dirs)
        self.paths = [d.path for d in cfg.cache_dirs]
        self.stores = [Store(p) for p in self.paths]
        # which volumes hold a slot of max_volumes, and whose: indexed and
        # queued volumes always do, others are forgotten (see volumeslots)
        self.slots = VolumeSlots(cfg.max_volumes, cfg.max_volumes_per_uid)
        self.index = Index(n, self.slots.adopt, self._forget_if_gone)
        self.health = Health(self.paths)
        self.caps = [DirCapacity(d.size, cfg.high_watermark, cfg.low_watermark,
                                 cfg.min_free_bytes, cfg.min_free_inodes) for d in cfg.cache_dirs]
        self.fill = FillQueue(cfg.fill_queue_bytes, cfg.fill_queue_share)
        self.workers = [DirWorker(str(i), loop) for i in range(n)]
        self.layout = self._make_layout()
        self._init_rebuild(n)
        self._init_upkeep(n)
        self._init_eviction(cfg.volume_quotas)
        self._checking: set[str] = set()  # keys whose file presence is being checked
        # fetch leases (leases.py): a block someone waits for is written
        # eagerly (its end wakes the loop at once), and every write's end is told
        self.awaited: Callable[[str], bool] = _never
        self.on_written: Callable[[str, bool], None] | None = None
        self.counters = dict(hits=0, misses=0, puts=0, put_bytes=0, writes=0, write_bytes=0,
                             write_errors=0, evictions=0, evicted_bytes=0, touches=0,
                             touch_bytes=0, slot_rewrites=0)
        self.put_reasons: dict[str, int] = {}
        # which blocks a full dir keeps; None = plain LRU (admit every block)
        self.policy = (Policy(self.index, self.counters, self._note_demoted)
                       if cfg.admission_policy != "lru" else None)
        # per volume: [touches, touch_bytes, puts, put_bytes]. Readers find hits
        # through the layout and report them by touch, and put a block after a
        # miss, so touches and puts are the reader hits and misses the daemon
        # truthfully sees (bytes are block-file sizes on both sides).
        self.volume_counters = self.slots.counters

    def _make_layout(self) -> Layout:
        return Layout([CacheDir(d.path, d.placement_weight, self.health.healthy[i])
                       for i, d in enumerate(self.cfg.cache_dirs)])

    @property
    def epoch(self) -> int:
        return self.health.epoch

    def _health_changed(self) -> None:
        self.layout = self._make_layout()

    def holds(self, key: str) -> bool:
        """`key` is indexed in a healthy dir: a reader finds its file."""
        i = self.layout.dir_index(key)
        return self.health.healthy[i] and key in self.index.dirs[i].lru

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
            c = self.slots.counter(vol)
            if c is not None:
                c[0] += count
                c[1] += size
        return n

    def _forget_if_gone(self, vol: str) -> None:
        """Free `vol`'s slot if it has no block cached and no put queued."""
        if vol not in self.index.volumes and vol not in self.fill.volumes:
            self.slots.release(vol)

    def finish_writes(self) -> None:
        """Account for the writes done since the last request (see `DirWorker`'s lazy jobs)."""
        for w in self.workers:
            w.drain()

    def put(self, key: str, data: bytes | memoryview | AreaSpan,
            owner: int | None = None, admin: bool = False) -> tuple[bool, str]:
        """Admit a validated block for background writing; (accepted, reason).
        `owner` (the peer's uid) is held to its share of the fill queue and,
        unless `admin`, of the volume slots. An accepted `AreaSpan` (a fill
        area's slot) is released on the dir's worker once its write no
        longer reads it; one not accepted is the caller's to release."""
        size = len(data)
        self.counters["puts"] += 1
        self.counters["put_bytes"] += size
        vol = key[:key.index("_")]
        reason = self._admit(key, vol, size, owner, None if admin else owner)
        self.put_reasons[reason] = self.put_reasons.get(reason, 0) + 1
        # counted after admission: a volume refused a slot has no counters
        c = self.slots.counter(vol)
        if c is not None:
            c[2] += 1
            c[3] += size
        if reason != "queued":
            self._forget_if_gone(vol)  # a new volume none of whose puts got in
            return False, reason
        i = self.layout.dir_index(key)
        self.caps[i].reserve(size)
        if self.quotas:
            self._vol_reserved[vol] = self._vol_reserved.get(vol, 0) + size
        write = self.stores[i].write
        if isinstance(data, AreaSpan):
            write = partial(_releasing, write)
        self.workers[i].submit(write, key, data, done=partial(self._written, i, key, size),
                               lazy=not self.awaited(key))
        return True, reason

    def _admit(self, key: str, vol: str, size: int, owner: int | None,
               slot_owner: int | None) -> str:
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
        reason = self.slots.claim(vol, slot_owner)
        if reason is not None:
            return reason
        reason = self.fill.offer(key, size, owner, vol)
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

    def _written(self, i: int, key: str, size: int, _: Any, exc: BaseException | None) -> None:
        indexed = False
        try:
            indexed = self._index_written(i, key, size, exc)
        finally:  # a write that failed or was cancelled may leave its volume empty
            if not indexed:
                self._forget_if_gone(key[:key.index("_")])
            if self.on_written is not None:
                self.on_written(key, indexed)

    def _index_written(self, i: int, key: str, size: int, exc: BaseException | None) -> bool:
        """Account for a finished write; whether its block is indexed now."""
        pending = self.fill.finish(key)
        self.caps[i].release(size)
        if self.quotas:
            vol = pending.volume
            left = self._vol_reserved.get(vol, 0) - size
            if left > 0:
                self._vol_reserved[vol] = left
            else:
                self._vol_reserved.pop(vol, None)
        if isinstance(exc, SlotRewritten):  # the putter's doing, not the disk's
            self.counters["slot_rewrites"] += 1
            log.warning("dropped the put of %s: %s (its reader rewrote the slot it named)",
                        key, exc)
            return False
        if exc is not None:
            self.counters["write_errors"] += 1
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                log.warning("cache dir %s is full (%s); refreshing free space", self.paths[i], exc)
                self._space_due[i] = 0.0
            elif self.health.error(i, exc):
                self._health_changed()
            return False
        self.health.ok(i)
        if pending.cancelled:
            self._unlink(i, [key])
            return False
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
        return True

    def evict_key(self, key: str) -> int:
        self.fill.cancel_key(key)
        if any(self.rebuilding):
            self._rebuild_evictions.add_key(key)
        hit = self.index.remove(key)
        if hit is None:
            return 0
        self._count_evictions("requested", 1, hit[1])
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
        if removed:
            self._count_evictions("requested", len(removed), sum(s for _, _, s in removed))
        per_dir: dict[int, list[str]] = {}
        for i, key, _ in removed:
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

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for queued puts to be written."""
        deadline = time.monotonic() + timeout
        while self.fill.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.fill.pending

    def close(self) -> None:
        for w in self.workers:
            w.stop()


def _always(_: str) -> bool:
    return True


def _never(_: str) -> bool:
    return False


def _releasing(write: Callable[[str, AreaSpan], None], key: str, span: AreaSpan) -> None:
    """`write`, then free the span's slot however it ended (on the dir's
    worker: the reader waiting for the slot needs no wake-up of the loop)."""
    try:
        write(key, span)
    finally:
        span.release()
