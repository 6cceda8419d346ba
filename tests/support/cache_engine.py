"""A `Cache` engine on real tmp dirs with its own event loop, for unit tests."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from blockcache_client.contract import blockfile
from blockcache_client.contract.blockkey import BlockKey
from blockcached import config
from blockcached.cache import Cache

VOLUME_KEY = bytes(range(32))


def key(vol: str = "v", inode: int = 1, offset: int = 0) -> str:
    return str(BlockKey(vol, inode, 0x1234, offset))


def block(k: str, size: int = 100) -> bytes:
    return blockfile.seal(k, b"x" * size, VOLUME_KEY, chunk_size=blockfile.MIN_CHUNK)


class Engine:
    """Cache + loop; `settle()` runs the loop until queued disk work is done."""

    def __init__(self, tmp: Path, sizes: list[int], **values):
        values.setdefault("min_free_bytes", 0)
        values.setdefault("min_free_inodes", 0)
        dirs = [config.CacheDirConfig(str(tmp / f"d{i}"), s) for i, s in enumerate(sizes)]
        self.cfg = config.build(values, {"cache_dirs": dirs})
        for d in dirs:
            os.makedirs(d.path, exist_ok=True)
        self.loop = asyncio.new_event_loop()
        self.cache = Cache(self.cfg, self.loop)
        self.cache.start_rebuild()
        self.settle()

    def settle(self, timeout: float = 10.0) -> None:
        """Run the loop until rebuild, writes and unlinks are all done."""
        async def idle():
            deadline = time.monotonic() + timeout
            while (any(self.cache.rebuilding) or self.cache.fill.pending
                   or any(w.backlog for w in self.cache.workers)):
                if time.monotonic() > deadline:
                    raise TimeoutError("cache engine did not settle")
                await asyncio.sleep(0.002)
        self.loop.run_until_complete(idle())

    def run_for(self, seconds: float) -> None:
        async def ticking():
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                self.cache.tick()
                await asyncio.sleep(0.01)
        self.loop.run_until_complete(ticking())

    def files(self, i: int = 0) -> dict[str, int]:
        """Block files on disk in dir i: name -> size."""
        out = {}
        for root, _, names in os.walk(os.path.join(self.cfg.cache_dirs[i].path, "blocks")):
            for n in names:
                if not n.startswith("."):
                    out[n] = os.path.getsize(os.path.join(root, n))
        return out

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.settle()
        self.cache.close()
        for w in self.cache.workers:
            w.join(5)
        self.loop.close()
