"""The in-memory index: which blocks are cached, their sizes, LRU order.

Layout, chosen for memory (target <= 250 bytes of RSS per entry):

- one plain dict per cache dir, `key -> packed int`, whose insertion order IS
  the LRU order (oldest first): a touch pops and re-inserts the key. The value
  packs `size << 32 | last_touch_seconds | count` so an entry costs one str,
  one int and one dict slot; no per-entry object. Touch times are kept to
  16 s, and the 4 bits below them count the block's accesses (saturating at
  15, halved by `halve_counts`): the capacity policy's frequency of a cached
  block, kept here because a touch rewrites the value anyway.
- one `SortedList` of all keys (the same str objects), for ordered listing and
  cheap range evictions: all keys of a volume start with `vol_`, of an inode
  with `vol_inode_`, and '_' cannot occur in a volume name.
- per-volume `[entries, bytes]` counters, kept exactly in step; the
  optional `on_volume_added` / `on_volume_emptied` callbacks hear of a volume's
  first block and of its last one leaving (the cache's volume slots).

The index does no I/O and knows nothing of capacity; `cache.Cache` decides
what to evict and the dir workers delete the files.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from sortedcontainers import SortedList

TIME_MASK = 0xFFFFFFFF
# Touch times are kept to this granularity (seconds, a power of two). Blocks
# mostly share a size (the volume's block size), so coarse times make many
# entries' packed values equal, and equal values share one int object.
TIME_GRAIN = 16
_VALUE_CACHE_MAX = 1 << 16
COUNT_MASK = TIME_GRAIN - 1  # the access count, in the low bits of the time field
# Counts at which a touch asks for the block's mtime to be written at once
# (it carries the count across a restart): at most 5 extra writes per block.
# Held as the counts before the touch that reaches 1 (a demoted block's
# first touch since: its 0 is on disk), 2, 4, 8 and 15.
_PERSIST_BEFORE = frozenset((0, 1, 3, 7, COUNT_MASK - 1))
_TOUCHED_MASK = TIME_MASK & -TIME_GRAIN  # the touch time, without the count
# Greater than every character a key may contain ([a-z0-9._-]).
_PREFIX_END = "\x7f"


class DirIndex:
    """Entries of one cache dir, in LRU order (first = least recently used)."""

    __slots__ = ("lru", "used_bytes")

    def __init__(self) -> None:
        self.lru: dict[str, int] = {}
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self.lru)


class Index:
    """key -> (dir, size, last touch) over several dirs, with LRU per dir."""

    def __init__(self, ndirs: int, on_volume_added: Callable[[str], None] | None = None,
                 on_volume_emptied: Callable[[str], None] | None = None):
        self.dirs = [DirIndex() for _ in range(ndirs)]
        self.keys = SortedList()
        self.volumes: dict[str, list[int]] = {}
        self._values: dict[int, int] = {}
        self._added = on_volume_added or _ignore
        self._emptied = on_volume_emptied or _ignore

    def _pack(self, size: int, touched: int) -> int:
        """`size << 32 | touched`, the low 4 bits of `touched` being the
        count; one shared int object per distinct value (32 bytes saved per
        entry whose value another entry already has)."""
        v = (size << 32) | (touched & TIME_MASK)
        cache = self._values
        shared = cache.get(v)
        if shared is None:
            if len(cache) >= _VALUE_CACHE_MAX:
                cache.clear()
            cache[v] = shared = v
        return shared

    # -- queries -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: str) -> bool:
        for d in self.dirs:
            if key in d.lru:
                return True
        return False

    def count_of(self, key: str) -> int:
        """How often `key` was accessed (0..15, 0 if absent)."""
        for d in self.dirs:
            v = d.lru.get(key)
            if v is not None:
                return v & COUNT_MASK
        return 0

    @property
    def used_bytes(self) -> int:
        return sum(d.used_bytes for d in self.dirs)

    def range(self, prefix: str | None = None, limit: int | None = None,
              after: str | None = None) -> Iterator[str]:
        """Keys in sorted order, all of them or those starting with `prefix`;
        only those sorting after `after` if given (the next page of a list)."""
        lo, hi = (None, None) if prefix is None else (prefix, prefix + _PREFIX_END)
        if after is not None and (lo is None or after >= lo):
            it = self.keys.irange(after, hi, inclusive=(False, False))
        elif lo is None:
            it = iter(self.keys)
        else:
            it = self.keys.irange(lo, hi, inclusive=(True, False))
        if limit is None:
            return it
        return (k for _, k in zip(range(limit), it))

    # -- updates -----------------------------------------------------------

    def add(self, key: str, dir_index: int, size: int, touched: int, count: int = 1) -> bool:
        """Insert as most recently used; False (and no change) if present."""
        if key in self:
            return False
        d = self.dirs[dir_index]
        d.lru[key] = self._pack(size, (touched & -TIME_GRAIN) | min(count, COUNT_MASK))
        d.used_bytes += size
        self.keys.add(key)
        self._count(key, 1, size)
        return True

    def add_many(self, dir_index: int, items: Iterable[tuple[int, str, int]]) -> int:
        """Bulk insert `(touched, key, size)`, given oldest first, each as more
        recent than the previous; keys already present are skipped. The low 4
        bits of `touched` are the entry's count."""
        d = self.dirs[dir_index]
        lru = d.lru
        fresh = []
        volumes = self.volumes
        pack = self._pack
        for touched, key, size in items:
            if key in self:
                continue
            lru[key] = pack(size, touched)
            d.used_bytes += size
            fresh.append(key)
            vol = key[:key.index("_")]
            c = volumes.get(vol)
            if c is None:
                volumes[vol] = [1, size]
                self._added(vol)
            else:
                c[0] += 1
                c[1] += size
        self.keys.update(fresh)
        return len(fresh)

    def touch(self, key: str, now: int, every: int) -> tuple[int, bool]:
        """Make `key` most recently used and count the access. Returns (dir or
        -1, whether to persist it now: its recorded touch time was older than
        `every` seconds and was renewed, or its count reached 2, 4, 8 or 15)."""
        for i, d in enumerate(self.dirs):
            lru = d.lru
            v = lru.pop(key, None)
            if v is None:
                continue
            count = v & COUNT_MASK
            if now - (v & _TOUCHED_MASK) < every:  # the common case: time recorded recently
                if count < COUNT_MASK:
                    # a plain +1, not shared through `_pack` (a lookup per hit):
                    # the value is shared again when its time is renewed
                    lru[key] = v + 1
                    return i, count in _PERSIST_BEFORE
                lru[key] = v
                return i, False
            count += count < COUNT_MASK
            lru[key] = self._pack(v >> 32, (now & -TIME_GRAIN) | count)
            return i, True
        return -1, False

    def halve_counts(self, dir_index: int, keys: Iterable[str]) -> None:
        """Halve the counts of `keys` in one dir (the policy's aging), keeping
        their LRU places; keys gone meanwhile are skipped."""
        lru = self.dirs[dir_index].lru
        for key in keys:
            v = lru.get(key)
            if v is not None and v & COUNT_MASK > 1:
                count = v & COUNT_MASK
                lru[key] = self._pack(v >> 32, (v & TIME_MASK) - count + (count >> 1))

    def demote(self, dir_index: int, count: int | None = None,
               through: str | None = None) -> list[str]:
        """Set to 0 the counts of one dir's least recently used entries: the
        first `count` of them, or those up to and including key `through`
        (the policy's stale rule), keeping their LRU places. Returns those
        that had a count above 0."""
        lru = self.dirs[dir_index].lru
        demoted = []
        for key in itertools.islice(lru, count):
            v = lru[key]
            if v & COUNT_MASK:
                lru[key] = self._pack(v >> 32, v & TIME_MASK & ~COUNT_MASK)
                demoted.append(key)
            if key == through:
                break
        return demoted

    def remove(self, key: str) -> tuple[int, int] | None:
        """Drop `key`; returns (dir, size) or None if absent."""
        for i, d in enumerate(self.dirs):
            v = d.lru.pop(key, None)
            if v is not None:
                size = v >> 32
                d.used_bytes -= size
                self.keys.remove(key)
                self._count(key, -1, -size)
                return i, size
        return None

    def remove_range(self, prefix: str | None) -> list[tuple[int, str, int]]:
        """Drop every key (prefix None) or every key starting with `prefix`;
        returns (dir, key, size) of each removed entry."""
        if prefix is None:
            out = [(i, k, v >> 32) for i, d in enumerate(self.dirs) for k, v in d.lru.items()]
            for d in self.dirs:
                d.lru.clear()
                d.used_bytes = 0
            self.keys.clear()
            emptied = list(self.volumes)
            self.volumes.clear()
            for vol in emptied:
                self._emptied(vol)
            return out
        keys = list(self.range(prefix))
        out = []
        for key in keys:
            i, size = self.remove(key)  # type: ignore[misc]
            out.append((i, key, size))
        return out

    def clear_dir(self, dir_index: int) -> int:
        """Drop every entry of one dir; returns how many."""
        keys = list(self.dirs[dir_index].lru)
        for key in keys:
            self.remove(key)
        return len(keys)

    def peek_lru(self, dir_index: int, free_bytes: int, free_entries: int = 0,
                 volume: str | None = None) -> list[tuple[str, int]]:
        """The least recently used entries of one dir (of one volume, if
        given) that would free at least `free_bytes` bytes and `free_entries`
        entries (fewer if the dir runs out), without removing them."""
        victims = []
        freed = 0
        if free_bytes <= 0 and free_entries <= 0:
            return victims
        prefix = None if volume is None else volume + "_"
        for key, v in self.dirs[dir_index].lru.items():
            if prefix is not None and not key.startswith(prefix):
                continue
            size = v >> 32
            victims.append((key, size))
            freed += size
            if freed >= free_bytes and len(victims) >= free_entries:
                break
        return victims

    def _count(self, key: str, n: int, size: int) -> None:
        vol = key[:key.index("_")]
        c = self.volumes.get(vol)
        if c is None:
            self.volumes[vol] = [n, size]
            self._added(vol)
        else:
            c[0] += n
            c[1] += size
            if c[0] == 0:
                del self.volumes[vol]
                self._emptied(vol)


def _ignore(_: str) -> None:
    pass
