"""Sequential reads fetch several blocks with one ranged request (Volume's
window), each block still sealed and cached under its own key; random reads
fetch only their block; a file changed mid-read is ESTALE and none of its new
bytes is cached under the old version's keys."""

from __future__ import annotations

import errno
import random
import threading

import pytest

from tests.support.volumes import BS, settle, volume, wait_connected

NBLOCKS = 13
WINDOW = 4  # blocks per request with memory_cache_bytes = 8 blocks (half the LRU)


def write_file(source, seed: int, name: str = "f.bin") -> bytes:
    data = random.Random(seed).randbytes((NBLOCKS - 1) * BS + 321)
    source.write(name, data)
    return data


def small_window(source, key_file, daemon=None, **kw):
    return volume(source, key_file, daemon, memory_cache_bytes=2 * WINDOW * BS, **kw)


def test_sequential_read_makes_fewer_requests_than_blocks(source, key_file, daemon):
    data = write_file(source, 1)
    with small_window(source, key_file, daemon) as vol:
        wait_connected(vol)
        assert vol._window == WINDOW
        got = bytearray()
        with vol.open("f.bin") as f:
            while chunk := f.read(BS):  # 64 KiB reads: a stream from the third one on
                got += chunk
        assert got == data
        s = vol.stats()
        # blocks 0 and 1 alone, then windows of 4 (the next one fetched in the
        # background half way through each): 5 requests for 13 blocks; a
        # reader overtaking a queued background job may add one or two
        assert s["backend_requests"] - s["version_checks"] <= 7
        assert s["backend_bytes"] == len(data)  # every block once
        assert s["prefetches"] >= NBLOCKS - 7
        settle(vol, daemon)
        assert [cached for _, _, cached in vol.block_map("f.bin")] == [True] * NBLOCKS
    assert daemon.client().stats()["entries"] == NBLOCKS
    # each block was sealed and put under its own key: a new reader with no
    # memory LRU reads every byte back from the cache, none from the source
    with volume(source, key_file, daemon, memory_cache_bytes=0) as warm:
        wait_connected(warm)
        assert warm.read("f.bin", 0, len(data)) == data
        assert warm.stats()["backend_requests"] == 0


def test_random_small_reads_fetch_only_their_block(source, key_file):
    data = write_file(source, 2)
    order = [7, 2, 11, 5, 0, 9]
    with small_window(source, key_file) as vol:
        for b in order:
            off = b * BS + (100 if b else 0)  # block 0 at offset 0: still a small read
            assert vol.read("f.bin", off, 4096) == data[off:off + 4096]
        s = vol.stats()
        assert s["backend_requests"] - s["version_checks"] == len(order)
        assert s["backend_bytes"] == len(order) * BS and s["prefetches"] == 0


def only_stream(vol):
    (st,) = vol._sequential._streams.values()
    return st


def test_small_reads_stepping_back_are_no_stream(local_source, key_file):
    """Each read starts a little before where the last one ended (within the
    slack a FUSE mount's late readahead requests need): random reads near
    each other, not a stream, so they fetch no window and keep their chunks."""
    data = write_file(local_source, 3)
    with small_window(local_source, key_file) as vol:
        for i in range(8):
            off = 10 * BS + 40_000 - i * 4096
            assert vol.read("f.bin", off, 1024) == data[off:off + 1024]
            assert not only_stream(vol).streaming, i
        s = vol.stats()
        assert s["backend_bytes"] == BS and s["prefetches"] == 0


def test_late_requests_of_a_stream_keep_it_a_stream(local_source, key_file):
    """FUSE's concurrent readahead requests arrive slightly out of order:
    one that starts before the last one's end neither breaks the stream nor
    counts as its next read."""
    bs, n = 1 << 20, 32 << 10  # the slack: an eighth of a block, four requests
    data = random.Random(4).randbytes(3 * bs)
    local_source.write("f.bin", data)
    with volume(local_source, key_file, block_size=bs, memory_cache_bytes=8 * bs) as vol:
        for k, i in enumerate([0, 1, 3, 2, 4, 6, 5, 7]):  # pairs swapped
            assert vol.read("f.bin", i * n, n) == data[i * n:(i + 1) * n]
            assert only_stream(vol).streaming == (k >= 2), (k, i)
        assert only_stream(vol).next_off == 8 * n


def test_file_changed_mid_sequential_read(source, key_file, daemon):
    old = write_file(source, 3)
    new = random.Random(4).randbytes(len(old))  # same size: only the version differs
    with small_window(source, key_file, daemon) as vol:
        wait_connected(vol)
        f = vol.open("f.bin")
        pinned = f.info
        got = bytearray(f.read(WINDOW * BS))  # 256 KiB at 0: blocks 0-3 in one request
        source.write("f.bin", new)
        with pytest.raises(OSError) as e:
            while chunk := f.read(BS):
                got += chunk
        assert e.value.errno == errno.ESTALE and "f.bin" in str(e.value)
        assert got == old[:len(got)]  # whatever was served is the pinned version
        settle(vol, daemon)
        cached = [c for _, _, c in vol.block_map("f.bin", info=pinned)]
    assert cached[:WINDOW] == [True] * WINDOW
    assert not all(cached)  # the blocks asked for after the change were not cached
    # every block cached under the old version's keys holds the old bytes: a
    # reader with no memory LRU reads them back from the cache
    with volume(source, key_file, daemon, memory_cache_bytes=0) as check:
        wait_connected(check)
        for b, is_cached in enumerate(cached):
            off = b * BS
            if is_cached:
                assert check.read("f.bin", off, BS, info=pinned) == old[off:off + BS]
            else:
                with pytest.raises(OSError) as again:
                    check.read("f.bin", off, BS, info=pinned)
                assert again.value.errno == errno.ESTALE
        assert check.read("f.bin", 0, len(new)) == new  # a fresh stat sees the new version


def test_concurrent_sequential_readers_fetch_each_block_once(source, key_file, daemon):
    data = write_file(source, 5)
    # the memory LRU holds the whole file (one window of NBLOCKS), so no block
    # can leave memory before its fill lands: a second fetch is the claim failing
    with volume(source, key_file, daemon, memory_cache_bytes=2 * NBLOCKS * BS) as vol:
        wait_connected(vol)
        info = vol.stat("f.bin")
        start = threading.Barrier(6)
        errors = []

        def reader():
            start.wait()
            with vol.open("f.bin") as f:
                got = bytearray()
                while chunk := f.read(WINDOW * BS):
                    got += chunk
            if got != data:
                errors.append(len(got))
        threads = [threading.Thread(target=reader) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and info == vol.stat("f.bin")
        s = vol.stats()
        # windows claim their blocks in the single-flight table: no block twice
        assert s["backend_bytes"] == len(data)
        assert s["backend_requests"] - s["version_checks"] < NBLOCKS
        settle(vol, daemon)
    assert daemon.client().stats()["entries"] == NBLOCKS

