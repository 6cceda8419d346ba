"""The cache engine's victim choice on real dirs: LRU order, max_entries,
the free-space floor, evictions by key, inode and volume."""

from __future__ import annotations

from tests.support.cache_engine import block, key
from tests.support.indexviews import lru_order, size_of


def test_lru_evicts_least_recently_touched_first(engines):
    e = engines([40_000], high_watermark=0.9, low_watermark=0.5, admission_policy="lru")
    keys = [key(inode=i + 1) for i in range(8)]
    for k in keys:
        e.cache.put(k, block(k, 4000))  # 4144-byte files: 8 fit under 36000
        e.settle()
    e.cache.touch([keys[0], keys[1]])
    k9 = key(inode=99)
    assert e.cache.put(k9, block(k9, 4000)) == (True, "queued")
    e.settle()
    # crossing 90% evicted just enough to stay under it: the oldest untouched
    remaining = lru_order(e.cache.index, 0)
    assert remaining == keys[3:] + keys[:2] + [k9]
    assert e.cache.index.dirs[0].used_bytes == 8 * size_of(e.cache.index, k9) <= 0.9 * 40_000
    assert set(e.files()) == set(remaining)
    assert e.cache.stats()["evictions_by_reason"] == {"admission": 1}


def test_max_entries(engines):
    e = engines([1 << 20], max_entries=10)
    for i in range(30):
        k = key(inode=i + 1)
        e.cache.put(k, block(k))
        assert len(e.cache.index) + sum(c.reserved_entries for c in e.cache.caps) <= 10
    e.settle()
    assert len(e.files()) == len(e.cache.index) <= 10


def test_free_space_floor_refuses_puts(engines):
    e = engines([1 << 20], min_free_bytes=1 << 60)
    e.run_for(0.1)  # first statvfs
    k = key()
    assert e.cache.put(k, block(k)) == (False, "no_space")


def test_evict_while_queued_leaves_nothing(engines):
    e = engines()
    k = key(vol="gone", inode=5)
    e.cache.put(k, block(k))
    assert e.cache.evict_prefix("gone") == 0  # still queued, not indexed
    e.settle()
    assert k not in e.cache.index and e.files() == {}


def test_evict_scopes(engines):
    e = engines([1 << 20, 1 << 20])
    ks = [key(vol=v, inode=i, offset=o) for v in ("a", "ab") for i in (1, 2) for o in (0, 4096)]
    for k in ks:
        e.cache.put(k, block(k))
    e.settle()
    total = e.cache.index.used_bytes
    assert e.cache.evict_key(ks[0]) == 1
    assert e.cache.evict_prefix("a", 2) == 2
    assert e.cache.evict_prefix("a") == 1
    assert sorted(e.cache.index.range()) == sorted(ks[4:])
    assert e.cache.evict_prefix(None) == 4
    e.settle()
    assert e.files(0) == {} and e.files(1) == {}
    # counted with the daemon's own evictions, by reason
    s = e.cache.stats()
    assert s["evictions_by_reason"] == {"requested": 8}
    assert s["evictions"] == 8 and s["evicted_bytes"] == total > 0
