"""The cache engine's upkeep on real dirs: health (errors, probes, a moved
tree, a hung disk) and recency persisted in mtimes."""

from __future__ import annotations

import os
import threading
import time

from blockcached import cache as cache_mod
from tests.support.cache_engine import block, key


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
