"""Cache layout: fan-out paths and weighted rendezvous placement."""

import os
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockcache_client.contract.blockkey import BlockKey
from blockcache_client.contract.layout import CacheDir, Layout, block_relpath, fanout

keys = st.builds(lambda i, o: str(BlockKey("vol", i, 0xABC, o)),
                 st.integers(1, 2**63 - 1), st.integers(0, 2**64 - 1))


def many_keys(n):
    return [str(BlockKey("vol", i + 1, 0x1234, 0)) for i in range(n)]


@given(keys, st.sampled_from([1, 2]))
def test_path_stays_under_its_dir(key, n_dirs):
    # one healthy dir has its own fast path in Layout.path: both are checked
    lay = Layout([CacheDir("/c/a", 1), CacheDir("/c/b", 1)][:n_dirs])
    path = lay.path(key)
    root = lay.dirs[lay.dir_index(key)].path
    assert os.path.normpath(path) == path
    assert path.startswith(root + "/blocks/")
    assert path == os.path.join(root, block_relpath(key))
    assert os.path.basename(path) == key
    assert len(fanout(key)) == 5 and fanout(key)[2] == "/"


def test_removing_a_dir_moves_only_its_keys():
    dirs = [CacheDir(f"/c/{i}", 100) for i in range(4)]
    full = Layout(dirs)
    less = Layout(dirs[:2] + dirs[3:])
    ks = many_keys(4000)
    moved = 0
    for k in ks:
        before = full.dirs[full.dir_index(k)].path
        after = less.dirs[less.dir_index(k)].path
        if before != "/c/2":
            assert before == after
        else:
            moved += 1
    assert 700 < moved < 1300  # about a quarter lived on the removed dir


def test_adding_a_dir_moves_keys_only_to_it():
    dirs = [CacheDir(f"/c/{i}", 100) for i in range(3)]
    old, new = Layout(dirs), Layout(dirs + [CacheDir("/c/new", 100)])
    for k in many_keys(3000):
        a = old.dirs[old.dir_index(k)].path
        b = new.dirs[new.dir_index(k)].path
        assert a == b or b == "/c/new"


def test_order_of_dirs_does_not_matter():
    dirs = [CacheDir(f"/c/{i}", 10 * (i + 1)) for i in range(4)]
    a, b = Layout(dirs), Layout(list(reversed(dirs)))
    for k in many_keys(500):
        assert a.path(k) == b.path(k)


def test_weighting():
    lay = Layout([CacheDir("/small", 1 << 30), CacheDir("/big", 3 << 30)])
    counts = Counter(lay.dirs[lay.dir_index(k)].path for k in many_keys(8000))
    share = counts["/big"] / 8000
    assert 0.71 < share < 0.79  # 3:1 weights -> 75 %


def test_unhealthy_dir_is_a_miss_and_moves_nothing():
    dirs = [CacheDir("/a", 1), CacheDir("/b", 1)]
    sick = Layout([dirs[0], CacheDir("/b", 1, healthy=False)])
    healthy = Layout(dirs)
    for k in many_keys(300):
        if healthy.dir_index(k) == 1:
            assert sick.path(k) is None
        else:
            assert sick.path(k) == healthy.path(k)


def test_wire_round_trip_and_errors():
    lay = Layout([CacheDir("/a", 5), CacheDir("/b", 7, False)])
    again = Layout.from_wire(lay.to_wire())
    assert again.dirs == lay.dirs
    for bad in ({}, {"dirs": [{"path": "/a"}]}, {"dirs": None},
                {"dirs": [{"path": "/a", "weight": "x", "healthy": True}]}):
        with pytest.raises(ValueError):
            Layout.from_wire(bad)
    with pytest.raises(ValueError):
        Layout([])
