"""The chunk cache and the block files kept open (`reader/chunks`, `chunkhits`,
`blockfds`), against a real daemon: right bytes, never stale, bounded."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.chunkvolumes import (
    BS,
    CHUNK,
    cli_evict,
    filled,
    same_version_rewrite,
    settle,
    volume,
)
from tests.support.waiting import wait_for

SIZE = 3 * BS + 12345  # three whole blocks and a short last one


EDGES = sorted({0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 4096, BS - CHUNK, BS - 1, BS,
                BS + 1, 2 * BS - 1, 3 * BS - 4096, 3 * BS, SIZE - 4096, SIZE - 1, SIZE})
LENGTHS = (1, 100, 4096, CHUNK - 1, CHUNK, CHUNK + 1, 128 << 10, 256 << 10)


def test_random_reads_match_and_warm_reads_come_from_chunks(local_source, key_file, daemon):
    data = random.Random(1).randbytes(SIZE)
    filled(local_source, key_file, daemon, "f.bin", data)
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        reads = [(o, n) for o in EDGES for n in LENGTHS]
        # shuffled: reads near the last one would look like a stream (`sequential`)
        random.Random(11).shuffle(reads)
        with vol.open("f.bin") as f:
            for _ in range(2):  # the second pass finds the chunks the first kept
                for off, n in reads:
                    f.seek(off)
                    assert f.read(n) == data[off:off + n], (off, n)
                    assert vol.read("f.bin", off, n) == data[off:off + n], (off, n)
                    buf = bytearray(n)
                    f.seek(off)
                    got = f.readinto(buf)
                    assert buf[:got] == data[off:off + n], (off, n)

            @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
            @given(st.integers(0, SIZE + 10), st.integers(0, 300 << 10))
            def check(off, n):
                f.seek(off)
                assert f.read(n) == data[off:off + n]
            check()
            s = vol.stats()
            # at most one per block, held for this handle (reads the sequential
            # detector takes for a stream keep none)
            assert 1 <= s["open_block_files"] <= 4
        s = vol.stats()
        assert s["open_block_files"] == 0  # closed with the handle
        assert s["misses"] == 0 and s["integrity_failures"] == 0
        assert s["chunk_hits"] > 2 * len(reads)  # most of the second pass at least
        assert 0 < s["chunk_bytes"] <= s["memory_bytes"] <= 64 << 20


@pytest.mark.parametrize("block_size", [4 << 10, 16 << 10, 128 << 10])
def test_small_blocks_and_chunks_serve_right_bytes_from_pages(local_source, key_file, daemon,
                                                              block_size):
    """Chunks as small as a page (blocks of 4 KiB upward): pages and runs
    cut from them serve the right bytes, epoch after epoch."""
    data = random.Random(16).randbytes(5 * block_size + 777)
    local_source.write("f.bin", data)
    rng = random.Random(17)
    reads = [(rng.randrange(len(data)), rng.choice((1, 100, 4096, 5000, 20000, 70000)))
             for _ in range(120)]
    with volume(local_source, key_file, daemon, block_size=block_size) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        with vol.open("f.bin") as f:
            for epoch in range(3):
                for off, n in reads:
                    f.seek(off)
                    assert f.read(n) == data[off:off + n], (epoch, off, n)
                if epoch == 0:
                    settle(vol, daemon)
        assert vol.stats()["chunk_hits"] > 0


def test_cold_random_reads_keep_their_chunks_for_the_next_epoch(local_source, key_file,
                                                                  daemon):
    """Chunks read while the block came from the source (before its fill
    landed) are kept under the header it was sealed with: the next epoch
    reads them from memory, though its blocks left the LRU."""
    data = random.Random(2).randbytes(16 * BS)
    local_source.write("big.bin", data)
    offsets = random.Random(3).sample(range(0, 16 * BS, 4096), 40)
    with volume(local_source, key_file, daemon, memory_cache_bytes=8 << 20) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        with vol.open("big.bin") as f:
            for off in offsets:
                f.seek(off)
                assert f.read(4096) == data[off:off + 4096]
            settle(vol, daemon)
            before = vol.stats()
            assert before["misses"] > 0
            for off in offsets:
                f.seek(off)
                assert f.read(4096) == data[off:off + 4096]
        after = vol.stats()
    assert after["misses"] == before["misses"]

    def decrypted(s):  # hits neither in a kept block nor in kept chunks
        return s["hits"] - s["memory_hits"] - s["chunk_hits"]
    assert after["chunk_hits"] > before["chunk_hits"]
    assert decrypted(after) - decrypted(before) <= 10  # of 40; the LRU is 8 MiB
    assert after["memory_bytes"] <= 8 << 20


def test_small_reads_keep_pages_so_an_epoch_fits_a_budget_its_chunks_do_not(
        local_source, key_file, daemon):
    """300 random 4 KiB reads: their 64 KiB chunks (19 MiB) would not fit a
    4 MiB budget, their pages (1.2 MiB) do, so the second epoch decrypts
    nothing, however the handles were opened."""
    data = random.Random(12).randbytes(32 * BS)
    filled(local_source, key_file, daemon, "f.bin", data)
    offsets = random.Random(13).sample(range(0, len(data) - 4096, 4096), 300)
    offsets = [o + (o // 4096) % 7 * 100 for o in offsets]  # some straddle two pages
    with volume(local_source, key_file, daemon, memory_cache_bytes=4 << 20) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        for _ in range(2):  # the second epoch finds every page the first kept
            before = vol.stats()
            with vol.open("f.bin") as f:
                for off in offsets:
                    f.seek(off)
                    assert f.read(4096) == data[off:off + 4096]
            after = vol.stats()
        assert after["chunk_hits"] - before["chunk_hits"] == len(offsets)
        assert after["hits"] - before["hits"] == len(offsets)
        assert after["misses"] == 0
        assert after["chunk_bytes"] <= 2 * 4096 * len(offsets)
        assert after["memory_bytes"] <= 4 << 20


def test_a_small_read_is_served_from_the_chunk_a_larger_read_kept(local_source, key_file,
                                                                  daemon):
    data = random.Random(14).randbytes(2 * BS)
    filled(local_source, key_file, daemon, "f.bin", data)
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        with vol.open("f.bin") as f:
            f.seek(CHUNK)
            assert f.read(CHUNK) == data[CHUNK:2 * CHUNK]  # keeps chunk 1
            hits = vol.stats()["chunk_hits"]
            for off in (CHUNK + 5, 2 * CHUNK - 4096):
                f.seek(off)
                assert f.read(4096) == data[off:off + 4096]
            assert vol.stats()["chunk_hits"] == hits + 2


def test_a_repeated_aligned_read_is_the_kept_bytes_object(local_source, key_file, daemon):
    """A read of whole chunks keeps them as one piece: reading the same range
    again returns that object, with no copy; a read inside it is a copy."""
    data = random.Random(15).randbytes(2 * BS)
    filled(local_source, key_file, daemon, "f.bin", data)
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        with vol.open("f.bin") as f:
            got = []
            for off, n in ((BS + 2 * CHUNK, 2 * CHUNK), (BS + 2 * CHUNK, 2 * CHUNK),
                           (BS + 2 * CHUNK + 100, CHUNK)):
                f.seek(off)
                got.append(f.read(n))
                assert got[-1] == data[off:off + n]
        assert got[1] is got[0]
        assert vol.stats()["chunk_hits"] == 2


@pytest.mark.parametrize("refill", [True, False], ids=["refilled", "evicted"])
@pytest.mark.parametrize("through", ["handle", "read"])
def test_evicted_block_is_never_served_from_chunks(local_source, key_file, daemon, refill,
                                                   through):
    """The same path and version, new content in the block file (or none):
    the chunks kept from the old file are not served."""
    old = random.Random(4).randbytes(2 * BS)
    new = random.Random(5).randbytes(2 * BS)
    filled(local_source, key_file, daemon, "f.bin", old)
    off, n = BS + CHUNK + 100, 4096
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        f = vol.open("f.bin")
        try:
            def read():
                if through == "read":
                    return vol.read("f.bin", off, n, info=f.info)
                f.seek(off)
                return f.read(n)
            assert read() == old[off:off + n]
            assert read() == old[off:off + n]
            assert vol.stats()["chunk_hits"] >= 1
            # a read that missed under load (a slow open) fills the old block:
            # let that land before the evict, or it would come back after it
            settle(vol, daemon)
            cli_evict(daemon, vol, "f.bin")
            same_version_rewrite(local_source, "f.bin", new)
            assert vol.stat("f.bin", max_age=0).version == f.info.version
            if refill:
                filled_by_other = volume(local_source, key_file, daemon)
                with filled_by_other as other:
                    wait_for(lambda: other.stats()["daemon_connected"], what="the daemon")
                    assert other.read("f.bin", 0, 2 * BS) == new
                    settle(other, daemon)
            misses = vol.stats()["misses"]
            assert read() == new[off:off + n]
            assert vol.stats()["misses"] == misses + (0 if refill else 1)
        finally:
            f.close()


@pytest.mark.parametrize("through", ["handle", "read"])
def test_block_damaged_after_its_chunk_was_kept(local_source, key_file, daemon, through):
    """The kept plaintext was authenticated when decrypted: while the file in
    place is the same block (same header), serving it is right. A chunk not
    kept is read from the damaged file, fails, and comes from the source."""
    data = random.Random(6).randbytes(BS)
    filled(local_source, key_file, daemon, "f.bin", data)
    (path,) = [os.path.join(d, f) for c in daemon.cache_dirs
               for d, _, fs in os.walk(os.path.join(c, "blocks")) for f in fs]
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        f = vol.open("f.bin")
        try:
            def read(off, n):
                if through == "read":
                    return vol.read("f.bin", off, n)
                f.seek(off)
                return f.read(n)
            assert read(100, 4096) == data[100:4196]  # chunk 0 kept
            with open(path, "r+b") as bf:  # damage chunks 0 and 5 in place
                for chunk in (0, 5):
                    bf.seek(48 + chunk * (CHUNK + 16) + 500)
                    bf.write(b"\xff" * 64)
            assert read(100, 4096) == data[100:4196]
            assert vol.stats()["integrity_failures"] == 0
            off = 5 * CHUNK + 10
            assert read(off, 4096) == data[off:off + 4096]
            s = vol.stats()
            assert s["integrity_failures"] == 1 and s["misses"] == 1
        finally:
            f.close()


def test_memory_stays_within_the_budget(local_source, key_file, daemon):
    budget = 3 << 20  # three blocks' worth, shared by blocks and chunks
    data = random.Random(7).randbytes(8 * BS)
    local_source.write("f.bin", data)
    rng = random.Random(8)
    with volume(local_source, key_file, daemon, memory_cache_bytes=budget) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        with vol.open("f.bin") as f:
            for i in range(300):
                if i == 150:
                    settle(vol, daemon)
                off, n = rng.randrange(len(data)), rng.choice((512, 4096, 100_000))
                f.seek(off)
                assert f.read(n) == data[off:off + n]
                s = vol.stats()
                assert s["chunk_bytes"] <= s["memory_bytes"] <= budget
        assert vol.stats()["chunk_bytes"] > 0


def test_switched_off_keeps_no_chunks(local_source, key_file, daemon):
    data = random.Random(9).randbytes(2 * BS)
    filled(local_source, key_file, daemon, "f.bin", data)
    with volume(local_source, key_file, daemon, chunk_cache=False) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        with vol.open("f.bin") as f:
            for _ in range(3):
                for off in (0, 70_000, BS + 5):
                    f.seek(off)
                    assert f.read(4096) == data[off:off + 4096]
            s = vol.stats()
        assert s["hits"] == 9 and s["chunk_hits"] == 0 and s["chunk_bytes"] == 0
        assert s["open_block_files"] == 0


def test_block_files_held_open_are_bounded_and_closed(local_source, key_file, daemon,
                                                      monkeypatch):
    from blockcache_client.reader.hits import blockfds
    monkeypatch.setattr(blockfds, "OPEN_LIMIT", 2)
    data = random.Random(10).randbytes(4 * BS)
    filled(local_source, key_file, daemon, "f.bin", data)

    def fds():
        """Descriptors open on cache files: other tests' threads in this process
        open and close descriptors of their own meanwhile."""
        held = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            held += any(target.startswith(d + "/") for d in daemon.cache_dirs)
        return held
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        base = fds()
        f, g = vol.open("f.bin"), vol.open("f.bin")
        for b in range(4):
            f.seek(b * BS + 10)
            assert f.read(100) == data[b * BS + 10:b * BS + 110]
        assert vol.stats()["open_block_files"] == 2 and fds() == base + 2
        g.seek(3 * BS)
        assert g.read(10) == data[3 * BS:3 * BS + 10]  # shares f's open block 3
        f.close()
        assert vol.stats()["open_block_files"] == 1  # block 3, still g's
        g.close()
        assert vol.stats()["open_block_files"] == 0 and fds() == base
