"""Victim choice and quotas: what admitting a put evicts (with the
policy's say, when there is one), trimming a dir back below its high
watermark, per-volume quotas, `max_entries`, and unlinking what leaves the
index on the dir's worker, in bounded jobs.

A mixin of `cache.Cache`: its methods use the cache's index, caps, policy,
fill queue, stores and workers.
"""

from __future__ import annotations

import logging

from .store import Store

log = logging.getLogger(__name__)

IO_BATCH = 2_000              # unlinks / mtime updates per worker job


class Eviction:
    """The cache's victim choice and quotas (see the module docstring)."""

    def _init_eviction(self, quotas: dict[str, int]) -> None:
        self.evicted_by: dict[str, int] = {}  # eviction reason -> blocks
        self.quotas = dict(quotas)  # volume -> max bytes over all dirs
        self._vol_reserved: dict[str, int] = {}  # volume -> bytes of admitted, unwritten puts

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


def _unlink_all(store: Store, keys: list[str]) -> None:
    for key in keys:
        store.unlink(key)
