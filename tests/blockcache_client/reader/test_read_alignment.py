"""Every pread of a cached block lands at its file offset's place in a page
(`common.aligned`): on AMD Zen the kernel's copy into a destination 1-31
bytes past the source (modulo 4 KiB) runs about six times slower."""

from __future__ import annotations

import ctypes
import os

from blockcache_client import Volume
from blockcache_client.common.aligned import PAGE
from tests.support.waiting import wait_for

BS = 1 << 20


def test_cached_block_preads_are_placed_like_the_page_cache(local_source, key_file, daemon,
                                                            monkeypatch):
    data = os.urandom(3 * BS + 7777)
    local_source.write("big.bin", data)
    kw = dict(socket_path=daemon.socket_path, block_size=BS, **local_source.options)
    with Volume("al", local_source.url, key_file, **kw) as filler:
        wait_for(lambda: filler.stats()["daemon_connected"], what="the daemon link")
        assert filler.read("big.bin", 0, len(data)) == data
        assert filler.wait_fills(20)
    daemon.wait_idle()
    placed = []
    real = os.preadv

    def preadv(fd, bufs, offset, *flags):
        for b in bufs:
            if len(b) >= PAGE:  # (the 48-byte header reads are not copies worth placing)
                placed.append((ctypes.addressof(ctypes.c_char.from_buffer(b)) % PAGE,
                               offset % PAGE))
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    with Volume("al", local_source.url, key_file, memory_cache_bytes=0, **kw) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon link")
        buf = bytearray(BS)
        with vol.open("big.bin") as f:  # large reads: on every core (`decrypt`)
            f.seek(12345)
            while n := f.readinto(buf):
                assert buf[:n] == data[f.tell() - n:f.tell()]
        for off, size in ((0, 100_000), (BS + 70_000, 5000), (2 * BS - 3, 200_000)):
            assert vol.read("big.bin", off, size) == data[off:off + size]  # one thread
        assert len(placed) > 10 and all(a == o for a, o in placed), placed
        info = vol.stat("big.bin")  # a read inside a block, from the kernel's caches only
        view = bytearray(100_000)
        assert vol.readinto_nowait("big.bin", BS + 300_000, view, info) == len(view)
        assert view == data[BS + 300_000:BS + 400_000]
        assert vol.stats()["misses"] == 0 and vol.stats()["parallel_decrypt_reads"] > 0
    assert all(a == o for a, o in placed), placed
