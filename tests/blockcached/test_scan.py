"""The start-up scan on a real dir: its verdicts (placement), mtime order,
and the same result from child processes as from one."""

from __future__ import annotations

import os

from blockcache_client.contract import layout
from blockcached import scan
from blockcached.store import Store
from tests.support.cache_engine import block, key


def _fill(s: Store, n: int) -> list[str]:
    keys = [key(inode=i + 1, offset=(i % 7) << 20) for i in range(n)]
    for k in keys:
        s.write(k, block(k))
    return keys


def test_parallel_scan_finds_the_same_as_one_process(tmp_path, monkeypatch):
    s = Store(str(tmp_path))
    s.prepare()
    keys = _fill(s, 300)
    bad = os.path.join(s.blocks, layout.fanout(keys[0]), "junk")
    open(bad, "wb").close()
    monkeypatch.setattr(scan, "PARALLEL_MIN_TOPS", 1)
    monkeypatch.setattr(scan, "PARALLEL_MIN_MIDS", 1)
    par = s.scan(None, 0, processes=2)
    assert not os.path.exists(bad) and par.removed == 1
    one = s.scan(None, 0, processes=1)
    assert len(par.runs) == 2 and len(one.runs) == 1
    merged = list(par.oldest_first())
    assert [m for m, _, _ in merged] == sorted(m for m, _, _ in merged)
    assert sorted(merged) == sorted(one.oldest_first())
    assert sorted(k for _, k, _ in one.oldest_first()) == sorted(keys)
    assert par.scanned == 301 and one.scanned == 300


def test_scan_keeps_only_what_placement_gives_this_dir(tmp_path):
    a, b = Store(str(tmp_path / "a")), Store(str(tmp_path / "b"))
    a.prepare()
    placement = ((a.path, 1), (b.path, 1))
    keys = _fill(a, 60)
    lay = layout.Layout([layout.CacheDir(a.path, 1), layout.CacheDir(b.path, 1)])
    mine = sorted(k for k in keys if lay.dir_index(k) == 0)
    assert 0 < len(mine) < 60
    found = a.scan(placement, 0)
    assert sorted(k for _, k, _ in found.oldest_first()) == mine
    assert found.removed == 60 - len(mine)
    left = sorted(n for _, _, names in os.walk(a.blocks) for n in names)
    assert left == mine


def test_oldest_first(tmp_path):
    s = Store(str(tmp_path))
    s.prepare()
    keys = _fill(s, 20)
    for i, k in enumerate(reversed(keys)):
        os.utime(s.block_path(k), (5000 + i, 5000 + i))
    r = s.scan(None, 0)
    assert [k for _, k, _ in r.oldest_first()] == list(reversed(keys))
