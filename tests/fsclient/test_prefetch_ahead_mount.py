"""`prefetch_ahead` in a job's main process fills what a FUSE mount of the
same volume (same name, key, block size and socket) then reads as hits."""

from __future__ import annotations

import os
import random

import pytest

from blockcache_client import Volume, prefetch_ahead
from tests.fsclient.conftest import BLOCK
from tests.support.waiting import wait_for

pytestmark = pytest.mark.fuse


def test_a_mount_of_the_same_volume_hits_after_prefetch_ahead(tmp_path, key_file, daemon,
                                                            mounts):
    root = tmp_path / "remote"
    rng = random.Random(22)
    files = {}
    for i in range(24):
        rel = f"train/c{i % 3}/img{i:03d}.jpg"
        files[rel] = rng.randbytes(BLOCK * 2 + 5 if i % 8 == 0 else rng.randint(1, 120 << 10))
        os.makedirs(root / os.path.dirname(rel), exist_ok=True)
        (root / rel).write_bytes(files[rel])
    m = mounts(root, daemon.socket_path)
    order = sorted(files)
    rng.shuffle(order)
    with Volume("testvol", str(root), str(key_file), socket_path=daemon.socket_path,
                block_size=BLOCK) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the volume to reach the daemon")
        it = prefetch_ahead(vol, order, depth=4)
        assert list(it) == order
        assert it.stats()["filled"] == len(files)
    for rel in order:
        with open(os.path.join(m.mountpoint, rel), "rb") as f:
            assert f.read() == files[rel], rel
    st = m.stats()
    assert st["misses"] == 0 and st["backend_bytes"] == 0, st
    assert st["hits"] >= sum(-(-len(d) // BLOCK) for d in files.values())
