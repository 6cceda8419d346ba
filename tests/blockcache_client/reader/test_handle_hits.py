"""A held file's repeat chunk hits take the handle's short path (`reader/handlehits`),
against a real daemon: served without the read path, never stale."""

from __future__ import annotations

import os
import random

import pytest

from blockcache_client.reader.readpath import ReadPath
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


def full_path_refused(vol, monkeypatch):
    """Make the full read path fail loudly: what still reads was served by the handle."""
    def refuse(*args, **kw):
        raise AssertionError("the full read path ran")
    monkeypatch.setattr(ReadPath, "read", refuse)


def test_repeat_reads_of_a_held_file_skip_the_read_path(local_source, key_file, daemon,
                                                        monkeypatch):
    data = random.Random(20).randbytes(2 * BS)
    filled(local_source, key_file, daemon, "f.bin", data)
    reads = [(BS + 100, 4096), (5 * CHUNK - 10, 128 << 10), (3 * CHUNK, CHUNK), (0, 1)]
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        with vol.open("f.bin") as f:
            for off, n in reads:  # the full path: decrypts and keeps the chunks
                f.seek(off)
                assert f.read(n) == data[off:off + n]
            before = vol.stats()
            with monkeypatch.context() as m:
                full_path_refused(vol, m)
                for off, n in reads:
                    f.seek(off)
                    assert f.read(n) == data[off:off + n], (off, n)
                    buf = bytearray(n)
                    f.seek(off)
                    assert f.readinto(buf) == n and buf == data[off:off + n], (off, n)
            after = vol.stats()
    # counted as the full path counts a chunk hit
    assert after["chunk_hits"] - before["chunk_hits"] == 2 * len(reads)
    assert after["hit_bytes"] - before["hit_bytes"] == 2 * sum(n for _, n in reads)
    assert after["misses"] == 0


def test_a_closed_and_reused_descriptor_is_not_trusted(local_source, key_file, daemon,
                                                       monkeypatch, tmp_path):
    """The table closed the handle's block file (its bound) and the number
    went to another file; the block was then evicted and filled with new
    bytes. The handle must not take the other file's link count for its
    block's: it reads the new block."""
    from blockcache_client.reader.hits import blockfds
    monkeypatch.setattr(blockfds, "OPEN_LIMIT", 1)
    old = random.Random(21).randbytes(2 * BS)
    new = random.Random(22).randbytes(2 * BS)
    filled(local_source, key_file, daemon, "f.bin", old)
    off, n = CHUNK + 7, 4096
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        with vol.open("f.bin") as f:
            f.seek(off)
            assert f.read(n) == old[off:off + n]  # block 0 held open, chunk kept
            (ent,) = f._handle._blocks.open.values()
            f.seek(BS + off)
            assert f.read(n) == old[BS + off:BS + off + n]  # pushes block 0's file out
            assert ent.closed
            other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
            if other != ent.fd:  # the number now names another, linked file
                os.dup2(other, ent.fd)
                os.close(other)
            try:
                cli_evict(daemon, vol, "f.bin")
                same_version_rewrite(local_source, "f.bin", new)
                with volume(local_source, key_file, daemon) as refiller:
                    wait_for(lambda: refiller.stats()["daemon_connected"], what="the daemon")
                    assert refiller.read("f.bin", 0, 2 * BS) == new
                    settle(refiller, daemon)
                f.seek(off)
                assert f.read(n) == new[off:off + n]
            finally:
                os.close(ent.fd)


def test_no_daemon_no_short_path(local_source, key_file, daemon):
    """Without the daemon every read is the backend's, as for the full path."""
    data = random.Random(23).randbytes(BS)
    filled(local_source, key_file, daemon, "f.bin", data)
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        with vol.open("f.bin") as f:
            for _ in range(2):
                f.seek(100)
                assert f.read(4096) == data[100:4196]
            daemon.stop()
            wait_for(lambda: not vol.stats()["daemon_connected"], what="the disconnect")
            hits = vol.stats()["hits"]
            f.seek(100)
            assert f.read(4096) == data[100:4196]
            s = vol.stats()
    assert s["hits"] == hits and s["misses"] == 1


def test_chunk_hits_counted_without_the_lock_add_up_exactly():
    """`Counters.chunk_hit` from many threads while others take snapshots:
    every hit and byte is counted once, and what waits stays bounded."""
    import threading

    from blockcache_client.common import counters as counters_mod
    c = counters_mod.Counters()
    per_thread, threads = 20_000, 4
    stop = threading.Event()
    most = [0]  # the most hits seen waiting

    def count():
        for _ in range(per_thread):
            c.chunk_hit(3)

    def watch():
        while not stop.is_set():
            c.snapshot()
            most[0] = max(most[0], len(c._chunk_hits))
    workers = [threading.Thread(target=count) for _ in range(threads)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    stop.set()
    watcher.join(60)
    s = c.snapshot()
    n = per_thread * threads
    assert (s["hits"], s["hit_bytes"], s["chunk_hits"]) == (n, 3 * n, n)
    assert most[0] <= counters_mod.PENDING_HITS + threads


@pytest.mark.parametrize("fetched_by", ["handle", "volume"])
def test_a_block_fetched_here_is_held_once_its_fill_landed(local_source, key_file, daemon,
                                                            monkeypatch, fetched_by):
    """A block this process fetched and sealed, never read through the
    chunk cache: once its fill is in place, the handle holds its file, so
    the next reads of it (the next epoch's) take the short path with the
    pages kept. Fetched by the handle itself: at its next read of the
    block; by another reader: when the handle reads it from memory."""
    data = random.Random(23).randbytes(2 * BS)
    local_source.write("f.bin", data)
    a, b = BS + 100, BS + 3 * CHUNK
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        with vol.open("f.bin") as f:
            if fetched_by == "handle":
                f.seek(a)
                assert f.read(4096) == data[a:a + 4096]  # a miss: fetched, filled
            else:
                assert vol.read("f.bin", a, 4096) == data[a:a + 4096]
            settle(vol, daemon)
            assert vol.stats()["open_block_files"] == 0
            if fetched_by == "volume":
                f.seek(b)
                assert f.read(4096) == data[b:b + 4096]  # from memory: the file is held
                assert vol.stats()["open_block_files"] == 1
            before = vol.stats()
            with monkeypatch.context() as m:
                full_path_refused(vol, m)
                for off in (a, b) if fetched_by == "volume" else (a,):
                    f.seek(off)
                    assert f.read(4096) == data[off:off + 4096]
            after = vol.stats()
            assert after["open_block_files"] == 1 and not f._handle._blocks.fetched
        assert after["chunk_hits"] - before["chunk_hits"] == (2 if fetched_by == "volume" else 1)
        assert after["misses"] == 1


def test_a_block_whose_fill_lost_is_not_looked_for_at_every_memory_hit(
        local_source, key_file, daemon, monkeypatch):
    """This process holds a block bound to the header it sealed, but the
    file in place is another reader's copy (its fill lost): the handle
    looks once, finds the other header and gives up, rather than opening
    the file again at every read served from memory. The bytes stay right."""
    data = random.Random(29).randbytes(2 * BS)
    local_source.write("f.bin", data)
    a = BS + 100
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        assert vol.read("f.bin", a, 4096) == data[a:a + 4096]  # sealed here, in memory
        settle(vol, daemon)
        cli_evict(daemon, vol, "f.bin")
        daemon.wait_idle()
        with volume(local_source, key_file, daemon) as other:  # another copy takes its place
            assert other.read("f.bin", a, 4096) == data[a:a + 4096]
            settle(other, daemon)
        looked = []
        hold = vol._hits.chunks.hold
        monkeypatch.setattr(vol._hits.chunks, "hold",
                            lambda *args: looked.append(1) or hold(*args))
        with vol.open("f.bin") as f:
            for off in (a, a + 8192, a + 3 * CHUNK, a):
                f.seek(off)
                assert f.read(4096) == data[off:off + 4096]
        assert len(looked) == 1
        assert vol.stats()["open_block_files"] == 0


def test_a_warm_4k_random_read_decrypts_one_chunk(local_source, key_file, daemon):
    data = random.Random(24).randbytes(2 * BS)
    filled(local_source, key_file, daemon, "f.bin", data)
    with volume(local_source, key_file, daemon) as vol:  # nothing of it in memory
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        decrypted = vol.stats()["chunks_decrypted"]
        with vol.open("f.bin") as f:
            off = BS + 3 * CHUNK + 100  # the handle's first read, not in its block's chunk 0
            f.seek(off)
            assert f.read(4096) == data[off:off + 4096]
            assert vol.stats()["chunks_decrypted"] - decrypted == 1
        off = 7 * CHUNK + 4000  # across no chunk boundary: one chunk again
        assert vol.read("f.bin", off, 4096) == data[off:off + 4096]
        assert vol.stats()["chunks_decrypted"] - decrypted == 2
        assert vol.stats()["misses"] == 0
