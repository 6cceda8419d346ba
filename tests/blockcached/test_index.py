"""The index against a plain model: LRU order per dir, accounting, range evictions."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockcache_client.contract.blockkey import BlockKey, key_prefix
from blockcached.index import Index
from tests.support.indexviews import lru_order, pop_lru, size_of

NDIRS = 2
VOLS = ["a", "b", "a.b", "a-1"]  # "a" is a string prefix of the others: ranges must not mix them

keys = st.builds(lambda v, i, o: str(BlockKey(v, i, 7, o)),
                 st.sampled_from(VOLS), st.integers(1, 12), st.integers(0, 3))


class IndexMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.index = Index(NDIRS)
        # model: per dir, an ordered list of keys (LRU first) and key -> size
        self.order: list[list[str]] = [[] for _ in range(NDIRS)]
        self.size: dict[str, int] = {}
        self.now = 1000

    def _dir(self, key):
        for i, o in enumerate(self.order):
            if key in o:
                return i
        return -1

    @rule(key=keys, d=st.integers(0, NDIRS - 1), size=st.integers(0, 1 << 24))
    def add(self, key, d, size):
        added = self.index.add(key, d, size, self.now)
        assert added == (key not in self.size)
        if added:
            self.order[d].append(key)
            self.size[key] = size

    @rule(key=keys, advance=st.integers(0, 100))
    def touch(self, key, advance):
        self.now += advance
        i, _ = self.index.touch(key, self.now, 60)
        assert i == self._dir(key)
        if i >= 0:
            self.order[i].remove(key)
            self.order[i].append(key)

    @rule(key=keys)
    def remove(self, key):
        got = self.index.remove(key)
        i = self._dir(key)
        if i < 0:
            assert got is None
        else:
            assert got == (i, self.size.pop(key))
            self.order[i].remove(key)

    @rule(vol=st.sampled_from(VOLS), inode=st.none() | st.integers(1, 12))
    def remove_range(self, vol, inode):
        prefix = key_prefix(vol, inode)
        removed = self.index.remove_range(prefix)
        want = sorted(k for k in self.size if BlockKey.parse(k).vol == vol
                      and (inode is None or BlockKey.parse(k).inode == inode))
        assert sorted(k for _, k, _ in removed) == want
        for i, k, size in removed:
            assert k in self.order[i] and size == self.size[k]
            self.order[i].remove(k)
            del self.size[k]

    @precondition(lambda self: len(self.size) > 0)
    @rule()
    def remove_all(self):
        removed = self.index.remove_range(None)
        assert sorted((k, s) for _, k, s in removed) == sorted(self.size.items())
        self.order = [[] for _ in range(NDIRS)]
        self.size.clear()

    @rule(d=st.integers(0, NDIRS - 1), free=st.integers(0, 1 << 25), count=st.integers(0, 5))
    def pop_lru(self, d, free, count):
        victims = pop_lru(self.index, d, free, count)
        # exactly the shortest LRU prefix of this dir that frees enough
        want, freed = [], 0
        for k in self.order[d]:
            if freed >= free and len(want) >= count:
                break
            want.append((k, self.size[k]))
            freed += self.size[k]
        assert victims == want
        for k, _ in victims:
            self.order[d].remove(k)
            del self.size[k]

    @invariant()
    def agrees_with_model(self):
        idx = self.index
        for i in range(NDIRS):
            assert lru_order(idx, i) == self.order[i]
            assert idx.dirs[i].used_bytes == sum(self.size[k] for k in self.order[i])
        assert list(idx.range()) == sorted(self.size)
        assert len(idx) == len(self.size)
        vols: dict[str, list[int]] = {}
        for k, s in self.size.items():
            c = vols.setdefault(k.split("_")[0], [0, 0])
            c[0] += 1
            c[1] += s
        assert idx.volumes == vols


TestIndex = IndexMachine.TestCase
TestIndex.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_add_many_keeps_given_order_and_skips_present():
    idx = Index(1)
    idx.add("v_1_00000000000000000000000000000000_0000000000000000", 0, 5, 1)
    n = idx.add_many(0, [(1, "v_2_00000000000000000000000000000000_0000000000000000", 10),
                         (2, "v_1_00000000000000000000000000000000_0000000000000000", 99),
                         (3, "v_3_00000000000000000000000000000000_0000000000000000", 20)])
    assert n == 2
    assert lru_order(idx, 0) == ["v_1_00000000000000000000000000000000_0000000000000000",
                                "v_2_00000000000000000000000000000000_0000000000000000",
                                "v_3_00000000000000000000000000000000_0000000000000000"]
    assert idx.dirs[0].used_bytes == 35
    assert idx.volumes == {"v": [3, 35]}


def test_touch_reports_stale_once_per_interval():
    idx = Index(1)
    k = "v_1_00000000000000000000000000000000_0000000000000000"
    idx.add(k, 0, 1, 100, count=15)  # a saturated count: only time makes it stale
    assert idx.touch(k, 130, 60) == (0, False)
    assert idx.touch(k, 160, 60) == (0, True)   # 60 s since the recorded 100
    assert idx.touch(k, 200, 60) == (0, False)  # recorded time is now 160


def test_touch_counts_accesses_and_asks_to_persist_at_milestones():
    idx = Index(1)
    k = "v_1_0000000000000000_0000000000000000"
    idx.add(k, 0, 7, 96)
    persisted = [c for c in range(2, 20) if idx.touch(k, 100, 10_000)[1]]
    assert idx.count_of(k) == 15 and size_of(idx, k) == 7
    assert persisted == [2, 4, 8, 15]  # the count each touch reached
    idx.halve_counts(0, [k, "v_2_0000000000000000_0000000000000000"])
    assert idx.count_of(k) == 7 and size_of(idx, k) == 7
