"""A real blockcached process: the protocol end to end, restarts, crashes, abuse."""

from __future__ import annotations

import os

import pytest

from blockcache_client import blockfile, layout
from blockcache_client.keys import BlockKey

VOLUME_KEY = bytes(range(32))


def make_key(vol: str = "vol", inode: int = 1, offset: int = 0, extent: int = 0xabc) -> str:
    return str(BlockKey(vol, inode, extent, offset))


def make_block(key: str, size: int = 4096) -> bytes:
    return blockfile.seal(key, os.urandom(size), VOLUME_KEY)


def test_put_lookup_touch_stats(daemon):
    c = daemon.client()
    hello = c.hello()
    assert hello["version"] == 1
    key = make_key()
    blob = make_block(key)
    assert c.put(key, blob) == (True, "queued")
    daemon.wait_idle()
    [path] = c.lookup([key])
    assert path == os.path.join(daemon.cache_dirs[0], layout.block_relpath(key))
    with open(path, "rb") as f:
        assert blockfile.unseal(key, f.read(), VOLUME_KEY) is not None
    assert c.lookup([make_key(offset=4096)]) == [None]
    assert c.touch([key])["touched"] == 1
    assert c.put(key, blob) == (False, "exists")
    s = c.stats()
    assert s["entries"] == 1 and s["hits"] == 1 and s["misses"] == 1
    assert s["used_bytes"] == len(blob)
    assert s["volumes"] == {"vol": {"entries": 1, "used_bytes": len(blob)}}
    assert os.stat(path).st_mode & 0o777 == 0o644
