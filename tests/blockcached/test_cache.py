"""The cache engine on real dirs: its operations against a model (capacity,
LRU, the index matching the files), the fill queue's share, put reasons.
Rebuild, eviction, upkeep and the dir workers have their own modules."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from blockcache_client.contract.blockkey import BlockKey
from tests.support.cache_engine import Engine, block, key
from tests.support.indexviews import dir_of, lru_order

CAP = 48 << 10
VOLS = ("a", "b")


class CacheMachine(RuleBasedStateMachine):
    """The engine on two small real dirs against a model of LRU order.

    The model does not redo the watermark arithmetic; it checks what must
    hold whatever it decides: the hard limit is never exceeded (counting
    admitted, unwritten puts), whatever was evicted was least recently used
    (a prefix of the model's order), range evictions take exactly their range,
    and after the disk work settles the index is exactly the files on disk.
    """

    def __init__(self):
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="bc-cache-machine-"))
        self.e = Engine(self.tmp, [CAP, CAP], fill_queue_bytes=1 << 20)
        self.order: list[list[str]] = [[], []]  # per dir, least recently used first

    def teardown(self):
        self.e.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _capacity_holds(self):
        for i, c in enumerate(self.e.cache.caps):
            assert self.e.cache.index.dirs[i].used_bytes + c.reserved <= CAP

    def _settle_and_reconcile(self, written: list[str]):
        self.e.settle()
        cache = self.e.cache
        for k in written:
            i = dir_of(cache.index, k)
            if i >= 0:
                if k in self.order[i]:  # evicted earlier in the burst, then put again
                    self.order[i].remove(k)
                self.order[i].append(k)
        for i in range(2):
            lru = lru_order(cache.index, i)
            survivors = [k for k in self.order[i] if k in cache.index.dirs[i].lru]
            assert survivors == lru
            gone = len(self.order[i]) - len(survivors)
            assert survivors == self.order[i][gone:], "evicted something more recent"
            self.order[i] = survivors
            on_disk = self.e.files(i)
            assert sum(on_disk.values()) <= CAP
            assert on_disk == {k: v >> 32 for k, v in cache.index.dirs[i].lru.items()}
            # at rest below the high watermark: a write landing above it trims
            assert cache.caps[i].need_bytes(cache.index.dirs[i].used_bytes, 0) == 0

    # blocks of up to 9 KB in 48 KB dirs: a few bursts cross the watermarks
    @rule(puts=st.lists(st.tuples(st.sampled_from(VOLS), st.integers(1, 30),
                                  st.integers(0, 9).map(lambda n: n * 1000)),
                        min_size=1, max_size=8))
    def put_burst(self, puts):
        """Puts admitted before any is written: concurrent puts."""
        written = []
        for vol, inode, size in puts:
            k = key(vol=vol, inode=inode, offset=size)
            ok, reason = self.e.cache.put(k, block(k, size))
            self._capacity_holds()
            if ok:
                written.append(k)
            elif reason == "exists":
                i = dir_of(self.e.cache.index, k)
                self.order[i].remove(k)
                self.order[i].append(k)
        self._settle_and_reconcile(written)

    @rule(pick=st.integers(0, 1 << 16))  # drawn independently of the state
    def touch(self, pick):
        cached = self.order[0] + self.order[1]
        if not cached:
            return
        k = cached[pick % len(cached)]
        assert self.e.cache.touch([k]) == 1
        i = dir_of(self.e.cache.index, k)
        self.order[i].remove(k)
        self.order[i].append(k)

    @rule(vol=st.sampled_from(VOLS), inode=st.none() | st.integers(1, 30))
    def evict_range(self, vol, inode):
        def hit(k):
            parsed = BlockKey.parse(k)
            return parsed.vol == vol and (inode is None or parsed.inode == inode)
        want = sum(hit(k) for o in self.order for k in o)
        assert self.e.cache.evict_prefix(vol, inode) == want
        self.order = [[k for k in o if not hit(k)] for o in self.order]
        self._settle_and_reconcile([])

    @invariant()
    def within_capacity(self):
        self._capacity_holds()


TestCacheMachine = CacheMachine.TestCase
# no example database: examples replayed from other runs would depend on old code
TestCacheMachine.settings = settings(max_examples=15, stateful_step_count=12, deadline=None,
                                     database=None)


def test_fill_queue_share_and_volume_bound(engines):
    e = engines([1 << 20], fill_queue_bytes=10_000, fill_queue_share=0.5, max_volumes=2)
    k1, k2, k3 = key(inode=1), key(inode=2), key(inode=3)
    assert e.cache.put(k1, block(k1, 4000), owner=1000) == (True, "queued")
    # uid 1000 holds 4144 of its 5000; another block would pass its share
    assert e.cache.put(k2, block(k2, 4000), owner=1000) == (False, "over_share")
    assert e.cache.put(k2, block(k2, 4000), owner=2000) == (True, "queued")  # others unaffected
    e.settle()
    assert e.cache.put(k3, block(k3, 4000), owner=1000) == (True, "queued")  # written: share back
    e.settle()
    # a second volume fits max_volumes; a third is refused and leaves no state
    w, x = key(vol="w"), key(vol="x")
    assert e.cache.put(w, block(w), owner=1000) == (True, "queued")
    assert e.cache.put(x, block(x), owner=1000) == (False, "too_many_volumes")
    e.settle()
    s = e.cache.stats()
    assert set(s["volumes"]) == {"v", "w"} and s["over_share"] == 1
    # once a volume is gone, a new one may take its place
    e.cache.evict_prefix("w")
    assert e.cache.put(x, block(x), owner=1000) == (True, "queued")
    e.settle()
    assert set(e.cache.stats()["volumes"]) == {"v", "x"}


def test_volume_slots_per_uid_and_forgetting(engines):
    """A uid brings in at most max_volumes_per_uid volumes, an admin's count to
    no uid, and a volume whose blocks are gone frees its slot (its counters
    stay while there is room); a rebuild finds volumes owned by nobody."""
    e = engines([1 << 20], max_volumes=4, max_volumes_per_uid=2, fill_queue_bytes=10_000)

    def put(vol: str, owner: int, admin: bool = False, size: int = 100) -> str:
        k = key(vol=vol)
        return e.cache.put(k, block(k, size), owner=owner, admin=admin)[1]

    assert [put(v, 1000) for v in ("a", "b", "c")] == ["queued", "queued", "volume_share"]
    assert put("d", 2000) == "queued"  # another uid has a share of its own
    assert put("e", 1000, admin=True) == "queued"  # an admin's volume counts to no uid
    assert put("f", 2000) == "too_many_volumes"  # max_volumes still bounds them all
    e.settle()
    assert e.cache.stats()["volume_slots"] == {"held": 4, "limit": 4, "per_uid": 2,
                                               "owners": 2, "unowned": 1}
    e.cache.evict_prefix("a")
    e.cache.evict_key(key(vol="b"))
    assert e.cache.stats()["volume_slots"]["held"] == 2
    # a new volume none of whose puts got in holds no slot; its counters stay
    assert put("g", 1000, size=20_000) == "queue_full"
    s = e.cache.stats()
    assert s["volume_slots"]["held"] == 2 and s["volumes"]["g"]["puts"] == 1
    assert [put(v, 1000) for v in ("h", "i", "j")] == ["queued", "queued", "volume_share"]
    e.settle()
    again = engines([1 << 20], sub="e", max_volumes=4, max_volumes_per_uid=2)
    assert again.cache.stats()["volume_slots"] == {"held": 4, "limit": 4, "per_uid": 2,
                                                   "owners": 0, "unowned": 4}


def test_volume_slots_after_a_failed_write_and_past_the_limit(engines, caplog):
    """A new volume whose only write failed holds no slot; a rebuild finding
    more volumes than max_volumes holds them all (logged once) and refuses
    new ones until some leave."""
    e = engines([1 << 20], max_volumes=4, max_volumes_per_uid=2)
    real_write = e.cache.stores[0].write

    def failing(key, data):
        raise OSError(5, "Input/output error")
    e.cache.stores[0].write = failing
    k = key(vol="lost")
    assert e.cache.put(k, block(k), owner=1000) == (True, "queued")
    e.settle()
    assert e.cache.stats()["volume_slots"]["held"] == 0
    e.cache.stores[0].write = real_write
    for v in ("a", "b", "c", "d"):
        k = key(vol=v)
        assert e.cache.put(k, block(k)) == (True, "queued")
    e.settle()
    with caplog.at_level("WARNING", logger="blockcached.volumeslots"):
        again = engines([1 << 20], sub="e", max_volumes=2)
    assert again.cache.stats()["volume_slots"]["held"] == 4
    assert sum("more than max_volumes (2)" in r.message for r in caplog.records) == 1
    k = key(vol="new")
    assert again.cache.put(k, block(k), owner=1000) == (False, "too_many_volumes")
    for v in ("a", "b", "c"):
        again.cache.evict_prefix(v)
    assert again.cache.put(k, block(k), owner=1000) == (True, "queued")


def test_put_reasons(engines):
    e = engines([20_000], fill_queue_bytes=10_000)
    k1, k2, k3 = key(inode=1), key(inode=2), key(inode=3)
    assert e.cache.put(k1, block(k1, 4000)) == (True, "queued")
    assert e.cache.put(k1, block(k1, 4000)) == (False, "duplicate")
    assert e.cache.put(k2, block(k2, 4000)) == (True, "queued")
    assert e.cache.put(k3, block(k3, 4000)) == (False, "queue_full")
    e.settle()
    assert e.cache.put(k1, block(k1, 4000)) == (False, "exists")
    big = key(inode=4)
    assert e.cache.put(big, block(big, 30_000)) == (False, "too_large")
    s = e.cache.stats()
    assert s["drops"] == 1 and s["writes"] == 2 and s["entries"] == 2
    assert s["put_results"] == {"queued": 2, "duplicate": 1, "queue_full": 1, "exists": 1,
                                "too_large": 1}


