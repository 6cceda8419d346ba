"""Block keys and sealed blocks for tests that talk to the daemon directly."""

from __future__ import annotations

import os

from blockcache_client.contract import blockfile
from blockcache_client.contract.blockkey import BlockKey

VOLUME_KEY = bytes(range(32))


def make_key(vol: str = "vol", inode: int = 1, offset: int = 0, extent: int = 0xabc) -> str:
    return str(BlockKey(vol, inode, extent, offset))


def make_block(key: str, size: int = 4096) -> bytes:
    return blockfile.seal(key, os.urandom(size), VOLUME_KEY)
