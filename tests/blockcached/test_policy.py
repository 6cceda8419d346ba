"""The capacity policy (frequency-gated admission) on the cache engine, with real dirs.

A "reader" here does what fsclient and `Volume` do: look a block up, and on a
miss put it. Sizes are small: blocks of ~1 KB in dirs of ~100 blocks.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import capacity, policy_sim
from blockcached import policy as policymod
from blockcached.index import Index
from blockcached.policy import Policy, decode_mtime_ns, encode_mtime_ns
from blockcached.staleness import StaleRule, Verdict
from tests.support.cache_engine import Engine, block, key
from tests.support.indexviews import lru_order, pop_lru

BLOCK = 1000
FILE = len(block(key(), BLOCK))
DIR = 100 * FILE


def read(e: Engine, keys: list[str]) -> float:
    """One pass over `keys` in order; the hit ratio. Writes land as they would
    between a reader's requests (each request first accounts for them)."""
    hits = 0
    for k in keys:
        e.cache.finish_writes()
        if e.cache.lookup([k])[0] is not None:
            hits += 1
        else:
            e.cache.put(k, block(k, BLOCK))
            e.settle()
    return hits / len(keys)


def shuffled(keys: list[str], seed: int) -> list[str]:
    out = list(keys)
    random.Random(seed).shuffle(out)
    return out


def usable_blocks(e: Engine) -> int:
    return int(e.cfg.high_watermark * DIR) // FILE


# -- the sketch and the mtime encoding ---------------------------------------

def test_sketch_counts_saturate_and_halve():
    p = Policy()  # a miss is how the sketch counts an access
    assert [p.miss("v_1_0_0") for _ in range(3)] == [0, 1, 2]
    for _ in range(40):
        p.miss("v_1_0_0")
    s = p.sketch
    assert s.estimate("v_1_0_0") == policymod.MAX_COUNT
    s.age()
    assert s.estimate("v_1_0_0") == policymod.MAX_COUNT // 2
    assert s.estimate("v_2_0_0") == 0
    assert p.miss("v_1_0_0") == policymod.MAX_COUNT // 2  # the table halved in place


def test_sketch_growth_keeps_counts():
    p = Policy()
    keys = [f"v_{i}_0_0" for i in range(1000)]
    for i, k in enumerate(keys):
        for _ in range(i % 5):
            p.miss(k)
    before = [p.sketch.estimate(k) for k in keys]
    p.fit(1 << 20)
    assert len(p.sketch.table) >= policymod.SLOTS_PER_ENTRY << 20
    assert [p.sketch.estimate(k) for k in keys] == before
    assert [p.miss(k) for k in keys] == before  # misses count in the grown table


def test_the_sketch_halves_every_sample_misses():
    p = Policy()
    sample = p.sketch.sample
    for i in range(sample - 1):
        p.miss(f"v_{i}_0_0")
    assert p.ages == 0
    p.miss("v_x_0_0")
    assert p.ages == 1
    for i in range(sample):
        p.miss(f"v_{i}_1_0")
    assert p.ages == 2


def _index(entries: int, count: int = 1, vol: str = "v") -> Index:
    index = Index(1)
    index.add_many(0, ((count, f"{vol}_{i}_0_0", 100) for i in range(entries)))
    return index


def _spied(p: Policy) -> list[int]:
    """The accesses at which `p`'s windows end."""
    ends: list[int] = []
    real = p.stale_rule.window_end
    p.stale_rule.window_end = lambda index, accesses, *a: (ends.append(accesses),
                                                           real(index, accesses, *a))
    return ends


def test_a_window_is_a_quarter_of_the_entries_read_at_its_start():
    """The stale rule's window: a quarter of the cached blocks' accesses
    (hits, touches and puts, read from the cache's counters), its length
    read at its start, not at every put."""
    index = _index(1000)
    counters = {"hits": 0, "touches": 0, "puts": 0}
    p = Policy(index, counters)
    ends = _spied(p)
    for i in range(policymod.MIN_WINDOW):  # the first window: sized before the index was
        counters["puts"] += 1
        p.miss(f"v_{i}_9_0")
    assert ends == [policymod.MIN_WINDOW]
    index.add_many(0, ((1, f"v_{i}_1_0", 100) for i in range(1000)))  # grows meanwhile...
    for i in range(1000 // 4):
        counters["puts"] += 1
        p.miss(f"v_{i}_8_0")
    assert ends == [policymod.MIN_WINDOW, policymod.MIN_WINDOW + 1000 // 4]  # ...not this one


def test_a_window_of_hits_ends_within_a_slice_of_misses():
    """Hits are not read at every miss: a window whose length came on hits
    alone ends at the first upkeep after, within window / UPKEEP_SPLIT misses."""
    index = _index(4000)
    counters = {"hits": 0, "touches": 0, "puts": 0}
    p = Policy(index, counters)
    p.fit(4000)  # a window of 1000 accesses from here
    ends = _spied(p)
    counters["hits"] = 5000  # the window's length passed on hits alone
    for i in range(1000 // policymod.UPKEEP_SPLIT):
        counters["puts"] += 1
        p.miss(f"v_{i}_2_0")
    assert ends == [5000 + 1000 // policymod.UPKEEP_SPLIT]


# -- the stale rule -------------------------------------------------------------

def _judge(index: Index, sample, accesses: int, misses: int = 0, returning: int = 0) -> Verdict:
    return StaleRule().judge(index, 0, sample, accesses, misses, returning)


def test_an_old_working_set_no_longer_hit_is_demoted():
    """Blocks hit while cached (counts of 3) whose oldest half then goes a
    whole window without a hit: every block untouched meanwhile drops to a
    count of 0, in its LRU place; what was touched or added keeps its count."""
    index = _index(1000, count=3)
    sample = StaleRule.sample(index, 0, accesses=0)
    for i in range(900, 950):
        index.touch(f"v_{i}_0_0", 0, 60)  # the youngest blocks: read again
    index.add_many(0, ((2, f"b_{i}_0_0", 100) for i in range(50)))  # the new job's
    order = lru_order(index, 0)
    v = _judge(index, sample, accesses=100)
    assert v.hit == 0 and v.demoted == 950
    assert lru_order(index, 0) == order
    assert {index.count_of(k) for k in order[:950]} == {0}
    assert {index.count_of(k) for k in order[950:1000]} == {4}  # touched
    assert {index.count_of(k) for k in order[1000:]} == {2}     # added


def test_leftovers_ahead_of_a_working_set_that_is_hit_are_demoted():
    """Job A's last blocks at the LRU head, job B's behind them being hit:
    the unhit run of A's is improbable for live blocks hit at B's rate, so
    exactly that run is demoted, in place; B's keep their counts."""
    index = _index(300, count=3, vol="a")
    index.add_many(0, ((2, f"b_{i}_0_0", 100) for i in range(700)))
    sample = StaleRule.sample(index, 0, accesses=0)
    for i in range(0, 200, 2):
        index.touch(f"b_{i}_0_0", 0, 60)
    v = _judge(index, sample, accesses=100)
    assert (v.run, v.demoted) == (300, 300)
    assert all(index.count_of(f"a_{i}_0_0") == 0 for i in range(300))
    assert all(index.count_of(f"b_{i}_0_0") >= 2 for i in range(700))


def test_a_dataset_read_once_is_not_demoted_until_it_is_asked_for_again():
    """A first epoch fills the cache with blocks read once (count 1), none hit
    yet: not stale, unless most misses are blocks coming back refused."""
    index = _index(1000, count=1)
    sample = StaleRule.sample(index, 0, accesses=0)
    assert _judge(index, sample, accesses=250, misses=250, returning=40).demoted == 0
    assert _judge(index, sample, accesses=250, misses=250, returning=200).demoted == 750


@settings(max_examples=60, deadline=None)
@given(hit_rate=st.floats(0.02, 1.0), seed=st.integers(0, 1 << 30))
def test_live_blocks_hit_in_random_order_are_not_demoted(hit_rate, seed):
    """Shuffled epochs: the oldest blocks are hit in random order, each with
    the same chance in a window. Demoting any of them takes a run of unhit
    blocks whose odds are below DEAD_ODDS (never, in these 60 draws)."""
    rng = random.Random(seed)
    index = _index(2000, count=3)
    sample = StaleRule.sample(index, 0, accesses=0)
    touched = [k for k in lru_order(index, 0)[:1000] if rng.random() < hit_rate]
    for k in touched:
        index.touch(k, 0, 60)
    assert _judge(index, sample, accesses=len(touched) + 1).demoted == 0


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("tae"), st.integers(0, 1999)), max_size=400),
       returning=st.booleans())
def test_a_block_touched_or_added_since_the_sample_is_never_demoted(ops, returning):
    """Whatever happens between a sample and its judgement (touches, puts,
    evictions from the head), the keys touched or added meanwhile keep their
    counts: only blocks proven untouched are demoted."""
    index = _index(2000, count=3)
    sample = StaleRule.sample(index, 0, accesses=0)
    fresh = set()
    for op, n in ops:
        if op == "t":
            k = f"v_{n}_0_0"
            if index.touch(k, 0, 60)[0] >= 0:
                fresh.add(k)
        elif op == "a":
            k = f"n_{n}_0_0"
            if index.add(k, 0, 100, 0, count=2):
                fresh.add(k)
        else:
            pop_lru(index, 0, 1)
    _judge(index, sample, accesses=len(ops), misses=10, returning=10 if returning else 0)
    assert all(index.count_of(k) > 0 for k in fresh if k in index)


def test_a_job_switch_at_realistic_scale():
    """Job A's dataset (1.5x the cache, 3 epochs), then job B's (0.8x): B
    reads all hits by its third epoch. In-process (`bench.policy_sim`: the
    real engine, no daemon, which would take minutes at this size), at
    32,768 blocks, where the sketch's collisions let part of B in during its
    first epoch and the old rule (returning misses per hit) never fired."""
    scale = capacity.Scale(32_768, 1000)
    b1, b2, b3 = capacity.working_set_change(scale, policy_sim.in_process)
    assert b3.hit_ratio >= 0.95, (b1, b2, b3)
    assert b3.notes["A blocks left"] <= 0.2 * scale.blocks


@given(seconds=st.integers(0, 1 << 33), count=st.integers(0, 100))
def test_mtime_carries_the_frequency(seconds, count):
    assert decode_mtime_ns(encode_mtime_ns(seconds, count)) == (seconds, min(count, 15))


def test_an_ordinary_mtime_carries_no_frequency():
    assert decode_mtime_ns(1_700_000_000_123_456_789) == (1_700_000_000, None)


# -- behaviours on the engine ----------------------------------------------------

@pytest.mark.parametrize("times", [1.5, 3])
def test_shuffled_epochs_keep_a_fixed_subset(engines, times):
    e = engines([DIR])
    data = [key(inode=i + 1) for i in range(int(100 * times))]
    optimum = usable_blocks(e) / len(data)
    ratios = [read(e, shuffled(data, epoch)) for epoch in range(4)]
    assert ratios[0] == 0
    assert min(ratios[1:]) >= 0.9 * optimum, (ratios, optimum)
    s = e.cache.stats()
    assert s["policy"]["rejected"]["less_frequent"] > 0
    assert s["used_bytes"] >= 0.9 * DIR  # the disk is used, not left a quarter empty


def test_lru_thrashes_on_the_same_epochs(engines):
    """The same reads under plain LRU: what the policy is for."""
    e = engines([DIR], admission_policy="lru")
    data = [key(inode=i + 1) for i in range(150)]
    optimum = usable_blocks(e) / len(data)
    ratios = [read(e, shuffled(data, epoch)) for epoch in range(4)]
    assert max(ratios[1:]) < 0.75 * optimum, ratios


def test_a_dataset_that_fits_is_all_hits(engines):
    e = engines([DIR])
    data = [key(inode=i + 1) for i in range(90)]
    ratios = [read(e, shuffled(data, epoch)) for epoch in range(3)]
    assert ratios[1:] == [1.0, 1.0]


def test_one_pass_over_a_cold_set_leaves_the_hot_set(engines):
    e = engines([DIR])
    hot = [key(vol="hot", inode=i + 1) for i in range(50)]
    for epoch in range(3):
        read(e, shuffled(hot, epoch))
    cold = [key(vol="cold", inode=i + 1) for i in range(300)]
    hits = total = 0
    rng = random.Random(7)
    for i, k in enumerate(cold):  # a validation sweep while training goes on
        read(e, [k])
        if i % 2:
            total += 1
            hits += read(e, [rng.choice(hot)])
    assert hits / total >= 0.9
    assert read(e, hot) >= 0.9
    assert e.cache.stats()["policy"]["rejected"]["less_frequent"] >= 200


def test_a_new_working_set_replaces_the_old(engines):
    e = engines([DIR])
    a = [key(vol="a", inode=i + 1) for i in range(150)]
    for epoch in range(3):
        read(e, shuffled(a, epoch))
    b = [key(vol="b", inode=i + 1) for i in range(80)]
    ratios = [read(e, shuffled(b, 10 + epoch)) for epoch in range(3)]
    assert ratios[2] >= 0.95, ratios
    s = e.cache.stats()
    assert s["policy"]["demoted"] > 0
    assert s["volumes"]["b"]["entries"] == 80


def test_a_restart_keeps_what_the_policy_learned(engines):
    e = engines([DIR], sub="r")
    data = [key(inode=i + 1) for i in range(150)]
    for epoch in range(3):
        read(e, shuffled(data, epoch))
    e.run_for(0.1)  # the tick persists the frequencies in the files' mtimes
    cached = sorted(e.cache.index.range())
    estimates = {k: e.cache.index.count_of(k) for k in cached}
    e.close()

    e2 = engines([DIR], sub="r")
    assert sorted(e2.cache.index.range()) == cached
    restored = {k: e2.cache.index.count_of(k) for k in cached}
    assert all(restored[k] >= min(estimates[k], 2) for k in cached), (estimates, restored)
    # a block seen before the restart is still refused in favour of the cached ones
    assert read(e2, shuffled(data, 3)) >= 0.9 * usable_blocks(e2) / len(data)
    assert sorted(e2.cache.index.range()) == cached


def test_a_demotion_survives_a_restart(engines):
    """Blocks the stale rule demoted come back from a restart with a count
    of 0 (written into their mtimes), not the count they had before: any
    block asked for before is still admitted over them."""
    e = engines([DIR], sub="d")
    a = [key(vol="a", inode=i + 1) for i in range(150)]
    for epoch in range(3):
        read(e, shuffled(a, epoch))
    read(e, shuffled([key(vol="b", inode=i + 1) for i in range(80)], 10))
    e.run_for(0.1)  # the tick writes the demotions into the files' mtimes
    counts = {k: e.cache.index.count_of(k) for k in e.cache.index.range()}
    demoted = sorted(k for k, n in counts.items() if n == 0)
    assert e.cache.stats()["policy"]["demoted"] > 0 and demoted
    e.close()

    e2 = engines([DIR], sub="d")
    restored = {k: e2.cache.index.count_of(k) for k in e2.cache.index.range()}
    assert restored.keys() == counts.keys()
    assert sorted(k for k, n in restored.items() if n == 0) == demoted
    assert all(restored[k] >= min(n, 2) for k, n in counts.items() if n), (counts, restored)


# -- properties -------------------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reads=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 59), st.integers(0, 3)),
                      min_size=20, max_size=150))
def test_capacity_never_exceeded_and_a_restart_keeps_the_decisions(reads):
    """Random reads of three volumes' blocks (sizes 0-3 KB), v0 with a quota
    of a third of the dir: the hard limit and the quota hold after every put
    (counting admitted, unwritten puts); every eviction made room for an
    admitted block; and a restarted engine keeps the same blocks and refuses
    whatever the running one would have refused."""
    tmp = Path(tempfile.mkdtemp(prefix="bc-policy-"))
    try:
        cap = 12 * FILE
        quota = cap // 3
        e = Engine(tmp, [cap], volume_quotas=(("v0", quota),))
        try:
            for vol, inode, size in reads:
                k = key(vol=f"v{vol}", inode=inode + 1, offset=size << 20)
                if e.cache.lookup([k])[0] is None:
                    e.cache.put(k, block(k, size * 1000))
                    c = e.cache.caps[0]
                    assert e.cache.index.dirs[0].used_bytes + c.reserved <= cap
                    v0 = e.cache.index.volumes.get("v0", (0, 0))[1]
                    assert v0 + e.cache._vol_reserved.get("v0", 0) <= quota
                    e.settle()
            s = e.cache.stats()
            by = s["evictions_by_reason"]
            assert s["evictions"] == by.get("admission", 0) + by.get("quota", 0)
            e.run_for(0.05)
            cached = sorted(e.cache.index.range())
            probe = [key(vol="new", inode=i + 1) for i in range(5)]
            before = [e.cache.policy.admit(0, [e.cache.index.count_of(v) for v, _ in
                                               e.cache.index.peek_lru(0, 1)]) for _ in probe]
        finally:
            e.close()
        e2 = Engine(tmp, [cap], volume_quotas=(("v0", quota),))
        try:
            assert sorted(e2.cache.index.range()) == cached
            after = [e2.cache.policy.admit(0, [e2.cache.index.count_of(v) for v, _ in
                                               e2.cache.index.peek_lru(0, 1)]) for _ in probe]
            assert [a is None for a in after] == [b is None for b in before] or all(
                a is None for a in after)
        finally:
            e2.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_policy_admits_on_frequency():
    p = Policy()
    assert p.admit(3, [1, 3]) is None       # ties stay with the cached block
    assert p.admit(4, [1, 3]) == "more_frequent"
    assert p.admit(1, [0]) == "more_frequent"  # over a demoted block
    assert p.admit(0, [0]) is None          # never seen before: still refused
    assert p.stats()["rejected"] == {"less_frequent": 2}


def test_an_evicted_block_keeps_its_count_for_its_return():
    p = Policy()
    p.evicted("v_1_0_0", 6)
    assert p.miss("v_1_0_0") == 6


def test_aging_halves_cached_counts_too(engines):
    e = engines([DIR])
    data = [key(inode=i + 1) for i in range(20)]
    for _epoch in range(5):
        read(e, data)
    assert {e.cache.index.count_of(k) for k in data} == {5}
    e.cache.policy.sketch.age()
    e.run_for(0.1)
    assert {e.cache.index.count_of(k) for k in data} == {2}
    assert lru_order(e.cache.index, 0) == data  # places kept


def test_a_put_with_room_costs_the_policy_nothing(engines):
    """A dir with room to spare decides nothing, so the policy reads and
    writes nothing: the block is indexed with a count of 1, the sketch keeps
    what it knew of it for its return, and the admissions with room are
    counted from the queued puts, not one by one."""
    e = engines([DIR])
    back = key(inode=1)
    e.cache.policy.evicted(back, 6)  # it was cached once, asked for 6 times
    table = bytes(e.cache.policy.sketch.table)
    assert e.cache.put(back, block(back, BLOCK)) == (True, "queued")
    e.settle()
    assert e.cache.index.count_of(back) == 1
    assert bytes(e.cache.policy.sketch.table) == table
    assert e.cache.policy.sketch.estimate(back) == 6
    assert e.cache.stats()["policy"]["admitted"] == {"room": 1}


def test_a_block_admitted_on_its_count_keeps_it(engines):
    """A block admitted into a full dir on its count is indexed with it (+1
    for this access), kept across a restart through its mtime."""
    e = engines([DIR])
    read(e, [key(inode=i + 100) for i in range(usable_blocks(e))])
    back = key(inode=1)
    e.cache.policy.evicted(back, 6)  # it was cached once, asked for 6 times
    assert e.cache.put(back, block(back, BLOCK)) == (True, "queued")
    e.settle()
    e.run_for(0.05)  # persists the count in the mtime
    assert e.cache.index.count_of(back) == 7
    assert e.cache.stats()["policy"]["admitted"]["more_frequent"] == 1
    mtimes = {p.name: os.stat(p).st_mtime_ns for p in Path(e.cfg.cache_dirs[0].path).rglob("*")
              if p.is_file() and p.name == back}
    assert decode_mtime_ns(mtimes[back])[1] == 7
