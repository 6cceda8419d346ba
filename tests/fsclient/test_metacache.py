"""The metadata caches: TTL per prefix, LRU bounds, negative entries, keep_cache."""

from __future__ import annotations

from blockcache_client.sources.fileinfo import FileInfo
from fsclient.config import TtlPolicy
from fsclient.metacache import NEGATIVE, MetaCache, TtlLru


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def info(path: str, version: str = "v1", is_dir: bool = False) -> FileInfo:
    return FileInfo(path=path, name=path.rpartition("/")[2], size=10, is_dir=is_dir,
                    is_link=False, mtime_ns=1, version=version, mode=0o644)


def test_lru_expires_and_evicts_by_weight():
    clock = Clock()
    lru = TtlLru(10, clock)
    lru.put("a", 1, ttl=5)
    lru.put("b", 2, ttl=50, weight=4)
    assert lru.get("a") == 1
    clock.now += 6
    assert lru.get("a") is None and lru.get("b") == 2
    lru.put("c", 3, ttl=50, weight=4)
    lru.get("b")                      # b is now the most recent
    lru.put("d", 4, ttl=50, weight=4)  # over 10: the least recent (c) goes
    assert lru.get("c") is None and lru.get("b") == 2 and lru.get("d") == 4
    assert lru.weight == 8 and lru.evictions == 1
    lru.put("e", 5, ttl=50, weight=11)  # heavier than the whole cache: not stored
    assert lru.get("e") is None and lru.weight == 8


def test_zero_ttl_stores_nothing_and_drops_an_older_entry():
    lru = TtlLru(10, Clock())
    lru.put("k", "old", ttl=60)
    lru.put("k", "new", ttl=0)
    assert lru.get("k") is None and len(lru) == 0


def test_lookup_answers_from_attrs_negatives_and_listings():
    clock = Clock()
    mc = MetaCache(TtlPolicy.build(60, {"code/": 0, "hot/": 2}), 1000, clock)
    assert mc.lookup("data/a") is None
    mc.put_listing("data", [info("data/a"), info("data/b")])
    assert mc.lookup("data/a").path == "data/a"
    assert mc.lookup("data/zzz") is NEGATIVE  # a listed dir answers "absent" too
    mc.put_negative("other/x")
    assert mc.lookup("other/x") is NEGATIVE
    mc.put_attr(info("other/x"))               # it appeared: the negative entry goes
    assert mc.lookup("other/x").path == "other/x"
    # zero-TTL prefix: never cached
    mc.put_attr(info("code/a.py"))
    mc.put_negative("code/b.py")
    mc.put_listing("code", [info("code/a.py")])
    assert mc.lookup("code/a.py") is None and mc.lookup("code/b.py") is None
    # short TTL prefix expires on its own schedule
    mc.put_attr(info("hot/x"))
    clock.now += 3
    assert mc.lookup("hot/x") is None and mc.lookup("data/a") is not None
    clock.now += 60
    assert mc.lookup("data/a") is None


def test_listing_entries_are_sorted_and_weighed():
    mc = MetaCache(TtlPolicy.build(60, {}), 1000, Clock())
    listing = mc.put_listing("d", [info("d/b"), info("d/a"), info("d/c")])
    assert [e.name for e in listing.entries] == ["a", "b", "c"]
    assert mc.listings.weight == 4
    mc.invalidate("d")
    assert mc.listing("d") is None


def test_keep_cache_only_for_an_unchanged_version_under_a_positive_ttl():
    mc = MetaCache(TtlPolicy.build(60, {"code/": 0}), 1000, Clock())
    assert mc.keep_cache(7, info("data/f", "v1")) is False   # first open
    assert mc.keep_cache(7, info("data/f", "v1")) is True    # same version again
    assert mc.keep_cache(7, info("data/f", "v2")) is False   # changed: drop pages
    assert mc.keep_cache(7, info("data/f", "v2")) is True
    mc.keep_cache(8, info("code/f", "v1"))
    assert mc.keep_cache(8, info("code/f", "v1")) is False   # zero TTL: never
