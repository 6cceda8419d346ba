"""The cache engine's rebuild from disk: entries, LRU order and counts
restored, junk cleaned, a returning dir rescanned."""

from __future__ import annotations

import os
import threading
import time

from blockcache_client.contract import layout
from tests.support.cache_engine import block, key
from tests.support.indexviews import dir_of, lru_order


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
