"""The store on a real dir: writes (tmp + rename), modes, probe and space."""

from __future__ import annotations

import os

from blockcache_client.contract import layout
from blockcached.store import Store
from tests.support.cache_engine import block, key


def test_write_is_complete_0644_and_leaves_no_temp(tmp_path):
    s = Store(str(tmp_path / "c"))
    old = os.umask(0o077)
    try:
        s.prepare()
        k = key()
        data = block(k)
        s.write(k, data)
    finally:
        os.umask(old)
    p = s.block_path(k)
    assert p == os.path.join(s.path, layout.block_relpath(k))
    assert open(p, "rb").read() == data
    assert os.stat(p).st_mode & 0o777 == 0o644
    # traversable, not listable: readers compute paths, tenants list nothing
    for d in (os.path.dirname(p), os.path.dirname(os.path.dirname(p)), s.blocks):
        assert os.stat(d).st_mode & 0o777 == 0o711
    assert os.stat(s.tmp).st_mode & 0o777 == 0o700
    assert os.listdir(s.tmp) == []


def test_write_remakes_fanout_dirs_removed_behind_its_back(tmp_path):
    # the store remembers leaf dirs it made; one removed since (by a person,
    # fsck, a health probe's new disk) must be made again, top dir included
    s = Store(str(tmp_path / "c"))
    s.prepare()
    k = key()
    s.write(k, block(k))
    top = os.path.join(s.blocks, layout.fanout(k).split("/")[0])
    for root, _dirs, files in os.walk(top, topdown=False):
        for f in files:
            os.unlink(os.path.join(root, f))
        os.rmdir(root)
    k2 = key(offset=1 << 22)
    blobs = {k: block(k), k2: block(k2)}
    for kk, data in blobs.items():
        s.write(kk, data)
    for kk, data in blobs.items():
        p = s.block_path(kk)
        assert open(p, "rb").read() == data
        assert os.stat(os.path.dirname(p)).st_mode & 0o777 == 0o711
    assert os.listdir(s.tmp) == []


def test_probe_and_space(tmp_path):
    s = Store(str(tmp_path))
    s.prepare()
    s.probe()
    assert os.listdir(s.blocks) == [] and os.listdir(s.tmp) == []
    sp = s.space()
    assert sp.free_bytes > 0 and sp.free_inodes > 0
