"""In-process metadata caches of one mount: attributes, directory listings
(the dentry cache), negative entries, and the file version seen at the last open.

Every cache is a bounded LRU (`TtlLru`) whose entries expire after the TTL of
their path's directory prefix (`config.TtlPolicy`). A TTL of 0 means "never
cached": the entry is not stored, so a zero-TTL prefix always asks the volume.

Invariants:
- No entry is served after its TTL: an entry is at most TTL old when served
  (the file system asks the volume for fresh answers, `max_age=0`, so the
  TTL is applied here and only here).
- Memory is bounded: a listing weighs one unit per entry, so one huge
  directory cannot hide behind a small entry count.
- The caches hold only what the volume said; nothing here is authoritative,
  and dropping any entry at any time is always correct.

Read and written by every worker thread: each `TtlLru` takes its own lock for
each call (a few dict operations), never around I/O.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any

from .config import TtlPolicy

if TYPE_CHECKING:
    from blockcache_client.sources.fileinfo import FileInfo

# `MetaCache.lookup` answer for "known not to exist".
NEGATIVE = object()


class TtlLru:
    """A map bounded by total weight, evicting the least recently used entry;
    each entry expires at its own deadline."""

    __slots__ = ("max_weight", "weight", "_data", "_clock", "evictions", "_lock")

    def __init__(self, max_weight: int, clock: Callable[[], float] = time.monotonic):
        if max_weight < 1:
            raise ValueError("max_weight must be >= 1")
        self.max_weight = max_weight
        self.weight = 0
        self.evictions = 0
        self._clock = clock
        # key -> (deadline, weight, value)
        self._data: OrderedDict[Hashable, tuple[float, int, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                return default
            if item[0] <= self._clock():
                self._remove(key)
                return default
            self._data.move_to_end(key)
            return item[2]

    def put(self, key: Hashable, value: Any, ttl: float, weight: int = 1,
            since: float | None = None) -> None:
        """Store `value` for `ttl` seconds from `since` (this map's clock: when
        the answer was asked for; default now); ttl <= 0 stores nothing (and
        drops an older entry, which would otherwise outlive the new answer)."""
        with self._lock:
            self._remove(key)
            if ttl <= 0 or weight > self.max_weight:
                return
            self._data[key] = ((self._clock() if since is None else since) + ttl, weight, value)
            self.weight += weight
            while self.weight > self.max_weight:
                old, (_, w, _) = self._data.popitem(last=False)
                self.weight -= w
                self.evictions += 1

    def pop(self, key: Hashable) -> None:
        with self._lock:
            self._remove(key)

    def deadline(self, key: Hashable) -> float | None:
        """When `key`'s entry expires (this map's clock), None if it has none."""
        item = self._data.get(key)
        return item[0] if item is not None else None

    def now(self) -> float:
        return self._clock()

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.weight = 0

    def _remove(self, key: Hashable) -> None:
        """(Under the lock.)"""
        item = self._data.pop(key, None)
        if item is not None:
            self.weight -= item[1]


class DirListing:
    """One directory's entries, sorted by name (the readdir order), plus a
    by-name index so lookups in a listed directory need no remote call."""

    __slots__ = ("entries", "by_name")

    def __init__(self, entries: Iterable[FileInfo]):
        self.entries: tuple[FileInfo, ...] = tuple(sorted(entries, key=lambda e: e.name))
        self.by_name: dict[str, FileInfo] = {e.name: e for e in self.entries}


def parent_of(path: str) -> str:
    return path.rpartition("/")[0]


class MetaCache:
    """The mount's metadata caches under one TTL policy."""

    def __init__(self, policy: TtlPolicy, max_entries: int = 200_000,
                 clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.attrs = TtlLru(max_entries, clock)
        self.listings = TtlLru(max_entries, clock)
        self.negative = TtlLru(max(max_entries // 4, 1), clock)
        # inode -> version at the last open; no TTL, only bounded (keep_cache)
        self.open_versions = TtlLru(max_entries, clock)

    def ttl(self, path: str) -> float:
        return self.policy.ttl_for(path)

    def lookup(self, path: str) -> FileInfo | object | None:
        """A cached FileInfo, NEGATIVE, or None (unknown: ask the volume)."""
        info = self.attrs.get(path)
        if info is not None:
            return info
        if self.negative.get(path) is not None:
            return NEGATIVE
        if not path:  # the root is an entry of no listing (parent_of("") is "" itself)
            return None
        listing = self.listings.get(parent_of(path))
        if listing is not None:
            info = listing.by_name.get(path.rpartition("/")[2])
            return NEGATIVE if info is None else info
        return None

    def put_attr(self, info: FileInfo, since: float | None = None) -> None:
        """Hold `info` for its TTL from `since` (`now()` when it was asked for)."""
        self.negative.pop(info.path)
        self.attrs.put(info.path, info, self.ttl(info.path), since=since)

    def put_negative(self, path: str) -> None:
        self.attrs.pop(path)
        self.negative.put(path, True, self.ttl(path))

    def listing(self, path: str) -> DirListing | None:
        return self.listings.get(path)

    def put_listing(self, path: str, entries: Iterable[FileInfo],
                    since: float | None = None) -> DirListing:
        listing = DirListing(entries)
        self.listings.put(path, listing, self.ttl(path), weight=len(listing.entries) + 1,
                          since=since)
        for e in listing.entries:
            self.put_attr(e, since)
        return listing

    def now(self) -> float:
        """The caches' clock: what `since` is given in."""
        return self.attrs.now()

    def invalidate(self, path: str) -> None:
        """Forget everything known about `path` (and its listing)."""
        self.attrs.pop(path)
        self.negative.pop(path)
        self.listings.pop(path)

    def fetched_ns(self, path: str) -> int:
        """When, in wall-clock ns, the answer held for `path` was asked for
        (its attribute entry's, else its directory listing's: a listing that
        took long holds what the source said at some time after its start);
        0 if none is held."""
        for cache, key in ((self.attrs, path), (self.listings, parent_of(path))):
            deadline = cache.deadline(key)
            if deadline is not None and path:
                age = cache.now() - (deadline - self.ttl(key))
                return time.time_ns() - int(age * 1e9)
        return 0

    def changed(self, path: str, info: FileInfo | None, tree: bool = False) -> None:
        """A write on this mount changed `path`: hold `info` (the version it
        uploaded) or nothing (the next stat asks the volume); its
        directory's listing is dropped, and with `tree` (a directory
        removed or renamed) everything cached, as entries under it may be."""
        self.invalidate(path)
        self.listings.pop(parent_of(path))
        if tree:
            self.attrs.clear()
            self.listings.clear()
            self.negative.clear()
        if info is not None:
            self.put_attr(info)

    def keep_cache(self, inode: int, info: FileInfo) -> bool:
        """Record an open of `info`; True when the kernel may keep its page
        cache: the prefix caches metadata (TTL > 0) and the version is the one
        seen at the previous open, so the cached pages hold these bytes."""
        previous = self.open_versions.get(inode)  # (a hit also refreshes its LRU place)
        if previous != info.version:
            self.open_versions.put(inode, info.version, float("inf"))
            return False
        return self.ttl(info.path) > 0

    def stats(self) -> dict[str, int]:
        return {"attrs": len(self.attrs), "listings": len(self.listings),
                "listing_weight": self.listings.weight, "negative": len(self.negative),
                "evictions": self.attrs.evictions + self.listings.evictions
                + self.negative.evictions}
