"""Volume against a real daemon, with a local-directory and a moto S3 backend."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockcache_client import Volume
from tests.support.volumes import BS, settle, volume, wait_connected
from tests.support.waiting import wait_for


def make_files(source, seed=0):
    rng = random.Random(seed)
    files = {
        "a/small.bin": rng.randbytes(1000),
        "a/exact.bin": rng.randbytes(2 * BS),
        "b/c/multi.bin": rng.randbytes(5 * BS + 123),
        "empty.bin": b"",
    }
    for rel, data in files.items():
        source.write(rel, data)
    return files


def random_reads(vol, files):
    names = sorted(files)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(names), st.integers(0, 6 * BS), st.integers(0, 3 * BS))
    def check(name, offset, size):
        assert vol.read(name, offset, size) == files[name][offset:offset + size]
    check()


def test_random_reads_cold_and_warm(source, key_file, daemon):
    files = make_files(source)
    with volume(source, key_file, daemon) as cold:
        wait_connected(cold)
        random_reads(cold, files)
        for name, data in files.items():  # fill every block
            assert cold.read(name, 0, len(data) + 10) == data
        settle(cold, daemon)
        s = cold.stats()
        assert s["misses"] > 0 and s["fills_sent"] > 0 and s["integrity_failures"] == 0
    before = daemon.client().stats()
    with volume(source, key_file, daemon, memory_cache_bytes=0) as warm:
        wait_connected(warm)
        random_reads(warm, files)
        s = warm.stats()
        assert s["misses"] == 0 and s["backend_requests"] == 0 and s["hits"] > 0
        for name, data in files.items():
            assert warm.cached_bytes(name) == len(data)
            assert warm.read(name, 0, len(data)) == data
        # accesses reach the daemon in batched touches (LRU order), not per read
        nblocks = sum(-(-len(d) // BS) for d in files.values())
        wait_for(lambda: daemon.client().stats()["touches"] - before["touches"] >= nblocks,
                 what="the batched touches")
    after = daemon.client().stats()
    # the hit path asks the daemon nothing: no lookups were made
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


def test_touches_are_batched(local_source, key_file, daemon):
    """Many reads of cached blocks: every block is reported to the daemon (LRU
    order stays right) in a few batched touch requests, not one per read."""
    files = {k: v for k, v in make_files(local_source).items() if v}
    with volume(local_source, key_file, daemon) as cold:
        wait_connected(cold)
        for name, data in files.items():
            assert cold.read(name, 0, len(data)) == data
        settle(cold, daemon)
    nblocks = sum(-(-len(d) // BS) for d in files.values())
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as warm:
        wait_connected(warm)
        before = daemon.client().stats()
        reads = 0
        for _ in range(40):
            for name, data in files.items():
                assert warm.read(name, 0, len(data)) == data
                reads += -(-len(data) // BS)
        assert warm.stats()["hits"] == reads
        wait_for(lambda: daemon.client().stats()["touches"] - before["touches"] >= nblocks,
                 what="every block read reported in a touch")
        after = daemon.client().stats()
    sent = after["requests"].get("touch", 0) - before["requests"].get("touch", 0)
    assert 1 <= sent <= reads // 20, (sent, reads)


def test_read_path_forms(local_source, key_file, daemon):
    files = make_files(local_source)
    with volume(local_source, key_file, daemon) as vol:
        data = files["b/c/multi.bin"]
        assert vol.read("/b/c/multi.bin", 0, 10) == data[:10]
        assert vol.read("b//c/multi.bin/", 10, 10) == data[10:20]
        buf = bytearray(3 * BS)
        assert vol.readinto("b/c/multi.bin", BS - 5, buf) == 3 * BS
        assert bytes(buf) == data[BS - 5:4 * BS - 5]
        assert vol.read("b/c/multi.bin", len(data), 10) == b""
        assert vol.read("b/c/multi.bin", 2**62, 10) == b""
        assert vol.read("empty.bin", 0, 100) == b""


def test_listdir_and_stat(source, key_file, daemon):
    files = make_files(source)
    with volume(source, key_file, daemon) as vol:
        root = {f.name: f for f in vol.listdir("")}
        assert {"a", "b", "empty.bin"} <= set(root)
        assert root["a"].is_dir and not root["empty.bin"].is_dir
        entries = {f.path: f for f in vol.listdir("a")}
        assert set(entries) == {"a/small.bin", "a/exact.bin"}
        info = entries["a/exact.bin"]
        assert info.size == 2 * BS and info.name == "exact.bin" and info.version
        assert vol.stat("a/exact.bin") == info
        assert vol.inode("/a/exact.bin") == vol.inode("a/exact.bin") != vol.inode("a/small.bin")
        # the listing filled the stat cache: a removed file still stats until refreshed
        source.remove("a/small.bin")
        assert vol.stat("a/small.bin").size == len(files["a/small.bin"])
        with pytest.raises(FileNotFoundError):
            vol.stat("a/small.bin", max_age=0)


def test_rewritten_file_gives_new_bytes_after_refresh(source, key_file, daemon):
    old = random.Random(1).randbytes(3 * BS)
    new = random.Random(2).randbytes(3 * BS)  # same size: only the version tells them apart
    source.write("f.bin", old)
    with volume(source, key_file, daemon, meta_ttl=3600) as vol:
        wait_connected(vol)
        assert vol.read("f.bin", 0, len(old)) == old
        settle(vol, daemon)
        pinned = vol.stat("f.bin")
        source.write("f.bin", new)
        fresh = vol.stat("f.bin", max_age=0)
        assert fresh.version != pinned.version
        for off in (0, BS - 7, 2 * BS):
            assert vol.read("f.bin", off, 100) == new[off:off + 100]
        # the old version stays readable where it is cached, and never mixes in
        assert vol.read("f.bin", 0, len(old), info=pinned) == old
        shorter = new[:BS]
        source.write("f.bin", shorter)
        assert vol.read("f.bin", 0, 10 * BS, info=vol.stat("f.bin", max_age=0)) == shorter


def test_file_changed_while_read_is_estale(local_source, key_file):
    data = random.Random(3).randbytes(4 * BS)
    local_source.write("g.bin", data)
    with volume(local_source, key_file) as vol:
        f = vol.open("g.bin")
        assert f.read(10) == data[:10]
        local_source.write("g.bin", data[:BS])  # shrinks under the open file
        f.seek(3 * BS)
        with pytest.raises(OSError) as e:
            f.read(10)
        assert e.value.errno == 116  # ESTALE
        assert "g.bin" in str(e.value) and "changed" in str(e.value)
        # and the new version reads fine once stat-ed again
        assert vol.read("g.bin", 0, 10 * BS, info=vol.stat("g.bin", max_age=0)) == data[:BS]


def test_daemon_killed_mid_run_then_restarted(local_source, key_file, daemon):
    rng = random.Random(4)
    files = {f"d/{i}.bin": rng.randbytes(BS + i) for i in range(12)}
    for rel, data in files.items():
        local_source.write(rel, data)
    names = sorted(files)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        wait_connected(vol)
        for n in names[:4]:
            assert vol.read(n, 0, len(files[n])) == files[n]
        settle(vol, daemon)
        daemon.kill()
        # every read keeps working, cached or not, while the daemon is gone
        for n in names[:8]:
            assert vol.read(n, 0, len(files[n])) == files[n]
        wait_for(lambda: not vol.stats()["daemon_connected"], what="the link to notice")
        for n in names:
            assert vol.read(n, 5, 1000) == files[n][5:1005]
        assert vol.stats()["daemon_unavailable"] > 0
        sent_before = vol.stats()["fills_sent"]
        daemon.start()
        wait_connected(vol)
        for n in names[8:]:
            assert vol.read(n, 0, len(files[n])) == files[n]
        settle(vol, daemon)
        assert vol.stats()["fills_sent"] > sent_before
        for n in names[8:]:
            assert vol.cached_bytes(n) == len(files[n])


def test_no_daemon_at_all_reads_from_backend(local_source, key_file, tmp_path):
    files = make_files(local_source)
    with volume(local_source, key_file, socket_path=str(tmp_path / "missing.sock")) as vol:
        for name, data in files.items():
            assert vol.read(name, 0, len(data)) == data
        s = vol.stats()
        assert s["daemon_unavailable"] > 0 and s["fills_sent"] == 0 and not s["daemon_connected"]
        assert vol.cached_bytes("a/exact.bin") == 0
        assert vol.evict("a/exact.bin") == 0


def test_prefetch_and_evict(local_source, key_file, daemon):
    files = make_files(local_source)
    with volume(local_source, key_file, daemon) as vol:
        wait_connected(vol)
        name = "b/c/multi.bin"
        assert vol.cached_bytes(name) == 0
        vol.prefetch(name, BS, 2 * BS)
        wait_for(lambda: vol.stats()["prefetches"] == 2, what="the prefetch")
        settle(vol, daemon)
        assert vol.cached_bytes(name) == 2 * BS
        vol.prefetch(name, 0, len(files[name]))
        wait_for(lambda: vol.stats()["prefetches"] == 6, what="the second prefetch")
        settle(vol, daemon)
        assert vol.cached_bytes(name) == len(files[name])
        assert vol.evict(name) == 6
        wait_for(lambda: vol.cached_bytes(name) == 0, what="the daemon to unlink the blocks")
        assert vol.read(name, 0, len(files[name])) == files[name]


def test_wait_fills_waits_for_the_prefetches_in_flight(local_source, key_file, daemon):
    # A prefetch still fetching (here from a slow source; or waiting for
    # another reader's fill under a lease) is a fill to come: wait_fills
    # returns once it landed, and the counters are final by then.
    data = os.urandom(4 * BS)
    local_source.write("slow.bin", data)
    with Volume("vol", f"latency::file://{local_source.root}", key_file,
                socket_path=daemon.socket_path, block_size=BS,
                latency={"delay": 0.5}) as vol:
        wait_connected(vol)
        info = vol.stat("slow.bin")
        vol.prefetch("slow.bin", 0, len(data), info)
        assert vol.wait_fills(30)
        daemon.wait_idle()
        assert vol.cached_bytes("slow.bin", info) == len(data)
        assert vol.stats()["prefetches"] == 4


def test_fill_queue_full_drops_are_counted(local_source, key_file, daemon):
    files = make_files(local_source)
    with volume(local_source, key_file, daemon, fill_queue_bytes=100) as vol:
        wait_connected(vol)
        for name, data in files.items():
            assert vol.read(name, 0, len(data)) == data
        settle(vol, daemon)
        s = vol.stats()
        # only the 1000-byte file's block is over the 100-byte budget too: all dropped
        assert s["fills_dropped"] >= 9 and s["fills_sent"] == 0
        assert daemon.client().stats()["entries"] == 0
        for name, data in files.items():
            assert vol.read(name, 0, len(data)) == data


def test_open_is_a_real_file_object(local_source, key_file, daemon):
    import io
    import tarfile

    import numpy as np
    from PIL import Image

    arr = np.arange(50_000, dtype=np.int32)
    buf = io.BytesIO()
    np.save(buf, arr)
    local_source.write("x/arr.npy", buf.getvalue())
    img = Image.new("RGB", (64, 48), (10, 200, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    local_source.write("x/img.png", buf.getvalue())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(3):
            payload = bytes([i]) * (BS + i)
            ti = tarfile.TarInfo(f"m{i}")
            ti.size = len(payload)
            tar.addfile(ti, io.BytesIO(payload))
    local_source.write("x/t.tar", buf.getvalue())
    with volume(local_source, key_file, daemon) as vol:
        with vol.open("x/arr.npy") as f:
            assert f.readable() and f.seekable()
            assert (np.load(f) == arr).all()
        with vol.open("x/img.png") as f, Image.open(f) as im:
            assert im.size == (64, 48) and im.getpixel((3, 3)) == (10, 200, 30)
        with vol.open("x/t.tar") as f, tarfile.open(fileobj=f) as tar:
            assert [m.name for m in tar.getmembers()] == ["m0", "m1", "m2"]
            assert tar.extractfile("m2").read() == bytes([2]) * (BS + 2)
        f = vol.open("x/t.tar")
        f.seek(-10, 2)
        assert f.tell() == len(buf.getvalue()) - 10 and len(f.read()) == 10
        f.close()
        with pytest.raises(ValueError):
            f.read(1)


def test_multi_block_read_is_one_request(local_source, key_file, daemon):
    data = random.Random(9).randbytes(12 * BS + 5)
    local_source.write("big.bin", data)
    with volume(local_source, key_file, daemon) as vol:
        wait_connected(vol)
        assert vol.read("big.bin", 100, len(data)) == data[100:]
        s = vol.stats()
        # all 13 blocks with one ranged read, 12 of them ahead of the first
        assert s["backend_requests"] == 1 and s["backend_bytes"] == len(data)
        assert s["prefetches"] == 12
        settle(vol, daemon)
        # each block sealed and put under its own key
        assert vol.block_map("big.bin") == [(b * BS, min(BS, len(data) - b * BS), True)
                                            for b in range(13)]
        assert daemon.client().stats()["entries"] == 13
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        # without room in memory for blocks fetched ahead, nothing is fetched ahead
        vol.evict("big.bin")
        wait_for(lambda: vol.cached_bytes("big.bin") == 0, what="eviction")
        assert vol.read("big.bin", 0, 3 * BS) == data[:3 * BS]
        s = vol.stats()
        assert s["prefetches"] == 0 and s["backend_requests"] == 3


def test_concurrent_readers_fetch_each_block_once(source, key_file, daemon):
    import threading
    data = random.Random(10).randbytes(6 * BS + 99)
    source.write("hot.bin", data)
    with volume(source, key_file, daemon) as vol:
        wait_connected(vol)
        info = vol.stat("hot.bin")
        errors = []
        start = threading.Barrier(8)

        def reader(seed):
            rng = random.Random(seed)
            start.wait()
            for _ in range(40):
                off = rng.randrange(0, len(data))
                size = rng.randrange(1, 2 * BS)
                if vol.read("hot.bin", off, size, info) != data[off:off + size]:
                    errors.append((off, size))
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        # single-flight (claims of coalesced runs too) + the memory LRU: every
        # block came from the backend once
        s = vol.stats()
        assert s["backend_bytes"] == len(data)
        assert s["backend_requests"] - s["version_checks"] <= 7
        settle(vol, daemon)
        assert daemon.client().stats()["entries"] == 7
