"""Cold blocks of large S3 files land in reused buffers (`common.bufferpool`),
with a real daemon and moto: the bytes equal the source's, callers get bytes
(never a view of a buffer that will be reused), the pool stays within its
bound, and the blocks are cached for the next reader."""

from __future__ import annotations

import random

import pytest

from blockcache_client import Volume
from blockcache_client.reader.options import buffer_bytes
from tests.support.waiting import wait_for

BS = 1 << 20
SIZE = 12 * BS + 4321
MEMORY = 4 * BS


def _volume(source, key_file, daemon, **kw) -> Volume:
    vol = Volume("coldbuf", source.url, key_file, socket_path=daemon.socket_path, block_size=BS,
                 memory_cache_bytes=MEMORY, **kw, **source.options)
    wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon link")
    return vol


@pytest.mark.parametrize("source", ["s3"], indirect=True)
def test_a_cold_large_read_reuses_its_buffers_and_fills_the_cache(source, key_file, daemon):
    data = random.Random(35).randbytes(SIZE)
    source.write("big.bin", data)
    with _volume(source, key_file, daemon) as cold:
        got = bytearray()
        with cold.open("big.bin") as f:
            while chunk := f.read(256 << 10):
                assert type(chunk) is bytes
                got += chunk
        assert got == data
        pool = cold._fetcher.buffers
        assert pool.reused > 0                      # blocks landed in buffers used before
        assert cold.stats()["read_buffer_bytes"] <= buffer_bytes(MEMORY)
        # random reads of the same file keep chunks: bytes of their own, not views
        rng = random.Random(36)
        for _ in range(20):
            off = rng.randrange(SIZE)
            piece = cold.read("big.bin", off, 5000)
            assert type(piece) is bytes and piece == data[off:off + 5000]
        pieces = [v for k, v in cold._mem._blocks.items() if isinstance(k, tuple)]
        assert all(type(v) is bytes for v in pieces)
        assert cold.wait_fills(20)
        assert cold.stats()["fills_dropped"] == 0
    with _volume(source, key_file, daemon) as warm:  # the next epoch: from the cache
        with warm.open("big.bin") as f:
            assert f.read() == data
        s = warm.stats()
        assert s["misses"] == 0 and s["hits"] > 0
