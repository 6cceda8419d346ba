"""The cache engine on real dirs: capacity, fill queue, evictions, rebuild, health."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from blockcache_client.contract import layout
from blockcache_client.contract.blockkey import BlockKey
from blockcached import cache as cache_mod
from tests.support.indexviews import dir_of, lru_order, size_of

from .engine import Engine, block, key

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


def test_max_entries(engines):
    e = engines([1 << 20], max_entries=10)
    for i in range(30):
        k = key(inode=i + 1)
        e.cache.put(k, block(k))
        assert len(e.cache.index) + e.cache._reserved_entries() <= 10
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
    assert e.cache.evict_key(ks[0]) == 1
    assert e.cache.evict_prefix("a", 2) == 2
    assert e.cache.evict_prefix("a") == 1
    assert sorted(e.cache.index.range()) == sorted(ks[4:])
    assert e.cache.evict_prefix(None) == 4
    e.settle()
    assert e.files(0) == {} and e.files(1) == {}


def test_rebuild_restores_entries_order_and_cleans(tmp_path, engines):
    e = engines([1 << 20, 1 << 20], sub="r")
    ks = [key(inode=i + 1) for i in range(20)]
    for k in ks:
        e.cache.put(k, block(k))
    e.settle()
    # distinct mtimes, oldest first in ks order
    for i, k in enumerate(ks):
        d = dir_of(e.cache.index, k)
        os.utime(e.cache.stores[d].block_path(k), (1_000_000 + i, 1_000_000 + i))
    d0 = e.cfg.cache_dirs[0].path
    stray = [
        os.path.join(d0, "tmp", "123.4"),                                   # interrupted write
        os.path.join(d0, "blocks", "00", "00", "not-a-key"),                # malformed name
        os.path.join(d0, "blocks", "00", "00", key(inode=555)),             # wrong fan-out
        # key format 1 (unkeyed ids, 16-digit extent) at its own fan-out path
        os.path.join(d0, layout.block_relpath("v_1_0000000000001234_0000000000000000")),
    ]
    # a key that belongs to the other dir, placed where dir 0 would keep it
    other = next(k for k in (key(inode=1000 + i) for i in range(100))
                 if e.cache.layout.dir_index(k) == 1)
    stray.append(os.path.join(d0, layout.block_relpath(other)))
    short = key(inode=777)
    for p in stray:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(block(key()))
    tiny = os.path.join(d0, layout.block_relpath(short))
    os.makedirs(os.path.dirname(tiny), exist_ok=True)
    open(tiny, "wb").close()  # a zero-length file (power loss without fsync)
    e.close()

    e2 = engines([1 << 20, 1 << 20], sub="r")
    assert sorted(e2.cache.index.range()) == sorted(ks)
    for i in range(2):
        order = lru_order(e2.cache.index, i)
        assert order == [k for k in ks if k in order]  # mtime order survived
    for p in stray + [tiny]:
        assert not os.path.exists(p), p
    assert e2.cache.rebuild_stats["state"] == "done"
    assert e2.cache.rebuild_stats["removed"] == len(stray) + 1


def test_unhealthy_dir_is_taken_out_and_probed_back(engines):
    e = engines([1 << 20], io_timeout=5)
    k = key()
    e.cache.put(k, block(k))
    e.settle()
    epoch = e.cache.epoch
    tmp = os.path.join(e.cfg.cache_dirs[0].path, "tmp")
    os.rename(tmp, tmp + ".away")
    os.rmdir(tmp + ".away")  # the daemon's tmp/ is gone: every write fails with ENOENT
    with open(tmp, "wb"):
        pass  # and a file where the dir was, which the probe must replace
    for i in range(3):
        k2 = key(inode=10 + i)
        assert e.cache.put(k2, block(k2))[0]
        e.settle()
    assert e.cache.health.healthy == [False]
    assert e.cache.epoch > epoch
    assert e.cache.lookup([k]) == [None]
    assert e.cache.put(key(inode=50), block(key(inode=50))) == (False, "unhealthy")
    assert e.cache.layout.path(k) is None
    e.cache.health.next_probe[0] = 0.0
    deadline = time.monotonic() + 5
    while not e.cache.health.healthy[0] and time.monotonic() < deadline:
        e.run_for(0.05)
    assert e.cache.health.healthy == [True]
    e.settle()  # the returned dir is rescanned
    [path] = e.cache.lookup([k])
    assert path is not None and os.path.exists(path)
    assert len(e.cache.index) == 1  # the failed writes left nothing behind
    assert os.path.isdir(tmp) and not os.path.islink(tmp)


def test_blocks_dir_moved_away_is_noticed_and_reopened(engines):
    """The store writes through descriptors of blocks/ and tmp/; a blocks/
    renamed behind its back (where readers no longer look) takes the dir out
    until a probe reopens the new one, instead of filling the old one."""
    e = engines([1 << 20], io_timeout=5)
    k = key()
    e.cache.put(k, block(k))
    e.settle()
    blocks = os.path.join(e.cfg.cache_dirs[0].path, "blocks")
    os.rename(blocks, blocks + ".away")
    deadline = time.monotonic() + 5
    while e.cache.health.healthy[0] and time.monotonic() < deadline:
        e.run_for(0.05)
    assert e.cache.health.healthy == [False]
    assert "moved behind the daemon" in e.cache.health.reason[0]
    e.cache.health.next_probe[0] = 0.0
    deadline = time.monotonic() + 5
    while not e.cache.health.healthy[0] and time.monotonic() < deadline:
        e.run_for(0.05)
    assert e.cache.health.healthy == [True]
    e.settle()
    k2 = key(inode=77)
    assert e.cache.put(k2, block(k2))[0]
    e.settle()
    assert os.path.isfile(e.cache.stores[0].block_path(k2))  # where readers look
    assert e.cache.lookup([k]) == [None]  # the rescan found it gone


def test_returning_dir_is_rescanned_so_lost_files_are_forgotten(engines):
    e = engines([1 << 20], io_timeout=0.2)
    ks = [key(inode=i + 1) for i in range(4)]
    for k in ks:
        e.cache.put(k, block(k))
    e.settle()
    gate = threading.Event()
    e.cache.workers[0].submit(gate.wait, 10)
    e.run_for(0.5)
    assert e.cache.health.healthy == [False]
    os.unlink(e.cache.stores[0].block_path(ks[0]))  # lost while the disk was out
    gate.set()
    e.cache.health.next_probe[0] = 0.0
    deadline = time.monotonic() + 5
    while not e.cache.health.healthy[0] and time.monotonic() < deadline:
        e.run_for(0.05)
    e.settle()
    assert sorted(e.cache.index.range()) == sorted(ks[1:])
    assert e.cache.stats()["used_bytes"] == sum(e.files().values())


def test_hung_operation_marks_dir_unhealthy(engines):
    e = engines([1 << 20], io_timeout=0.2)
    gate = threading.Event()
    e.cache.workers[0].submit(gate.wait, 10)  # a disk call that hangs
    e.run_for(0.5)
    assert e.cache.health.healthy == [False]
    assert "running for" in e.cache.health.reason[0]
    gate.set()
    e.cache.health.next_probe[0] = 0.0
    deadline = time.monotonic() + 5
    while not e.cache.health.healthy[0] and time.monotonic() < deadline:
        e.run_for(0.05)
    assert e.cache.health.healthy == [True]


def test_touches_persist_recency_in_mtimes(engines, monkeypatch):
    e = engines([1 << 20], sub="t")
    ks = [key(inode=i + 1) for i in range(3)]
    for k in ks:
        e.cache.put(k, block(k))
    e.settle()
    for k in ks:
        os.utime(e.cache.stores[0].block_path(k), (1000, 1000))
    monkeypatch.setattr(cache_mod, "TOUCH_PERSIST_AFTER", 0)
    e.cache.touch([ks[0]])
    e.run_for(0.3)
    e.settle()
    mtimes = [os.stat(e.cache.stores[0].block_path(k)).st_mtime for k in ks]
    assert mtimes[0] > time.time() - 60 and mtimes[1:] == [1000, 1000]


def test_lazy_jobs_finish_in_order_with_eager_ones(tmp_path):
    """A lazy job's `done` waits for a drain, a timer or an eager job, but
    every `done` still runs in submission order."""
    import asyncio
    import threading

    from blockcached.filler import DirWorker

    loop = asyncio.new_event_loop()
    worker = DirWorker("t", loop)
    ran: list[str] = []
    gate = threading.Event()
    try:
        def record(name):
            return lambda result, exc: ran.append(name)
        worker.submit(gate.wait, 10, done=record("lazy1"), lazy=True)
        worker.submit(lambda: None, done=record("lazy2"), lazy=True)
        worker.submit(lambda: None, done=record("eager"))
        worker.submit(lambda: None, done=record("lazy3"), lazy=True)
        gate.set()

        async def until_idle():
            while worker.backlog:
                await asyncio.sleep(0.001)
        loop.run_until_complete(asyncio.wait_for(until_idle(), 10))
        assert ran == ["lazy1", "lazy2", "eager", "lazy3"]
    finally:
        worker.stop()
        worker.join(5)
        loop.close()


def test_a_failing_jobs_bookkeeping_costs_only_that_job(tmp_path):
    """A `done` that raises is logged; the jobs behind it still finish and the
    lazy timer keeps going (a drain runs inside some unrelated request)."""
    import asyncio

    from blockcached.filler import DirWorker

    loop = asyncio.new_event_loop()
    worker = DirWorker("t", loop)
    ran: list[str] = []

    def broken(result, exc):
        raise RuntimeError("bookkeeping bug")
    try:
        worker.submit(lambda: None, done=broken, lazy=True)
        worker.submit(lambda: None, done=lambda r, e: ran.append("lazy"), lazy=True)

        async def until_idle():
            while worker.backlog:
                await asyncio.sleep(0.001)
        loop.run_until_complete(asyncio.wait_for(until_idle(), 10))
        assert ran == ["lazy"]
        assert worker._lazy_timer is None  # nothing lazy left: the timer stopped
    finally:
        worker.stop()
        worker.join(5)
        loop.close()


def test_a_request_first_accounts_for_finished_writes(engines, monkeypatch):
    """A put's write does not wake the loop; the next request runs its
    bookkeeping before answering, so a lookup right after the write hits."""
    from blockcached import filler
    from blockcached.service import Peer, Service

    monkeypatch.setattr(filler, "LAZY_DELAY", 60.0)  # no timer within the test
    e = engines([1 << 20])
    svc = Service(e.cfg, e.cache)
    worker = e.cache.workers[0]
    wakeups = []
    real_wake = worker._loop.call_soon_threadsafe
    monkeypatch.setattr(worker._loop, "call_soon_threadsafe",
                        lambda *a: wakeups.append(a) or real_wake(*a))
    k = key(inode=7)
    assert e.cache.put(k, block(k, 4000)) == (True, "queued")
    deadline = time.monotonic() + 10
    while not worker._finished:        # written by the dir's thread, loop not run
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert k in e.files() and wakeups == []  # the write's end did not wake the loop
    reply = svc.handle({"op": "lookup", "id": 1, "keys": [k]}, Peer(os.getpid(), 0, 0))
    assert reply["paths"][0], reply
    assert e.cache.workers[0].backlog == 0
