"""Volume under faults: corrupt and foreign blocks, several processes, fork, bad input."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import random

import pytest

from blockcache_client import Volume
from blockcache_client.contract.blockfile import unseal
from blockcache_client.contract.errors import ConfigError, IntegrityError
from blockcache_client.volumekey import generate_key_file, load_key_file
from tests.support.volumes import (
    BS,
    cached_block_path,
    damage_block,
    fill,
    settle,
    volume,
    wait_connected,
)
from tests.support.waiting import wait_for


def _read_via(vol, how, rel, size):
    if how == "read":
        return vol.read(rel, 0, size)
    buf = bytearray(size)  # readinto decrypts straight into the caller's buffer
    assert vol.readinto(rel, 0, buf) == size
    return bytes(buf)


@pytest.mark.parametrize("how", ["read", "readinto"])
@pytest.mark.parametrize("where", ["header", "body", "tag", "truncate", "extend"])
def test_corrupt_block_detected_evicted_and_refilled(local_source, key_file, daemon, where, how):
    data = random.Random(5).randbytes(BS + 500)
    local_source.write("c.bin", data)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        fill(vol, daemon, "c.bin", data)
        key, path = cached_block_path(vol, daemon, "c.bin")
        damage_block(path, where)
        assert _read_via(vol, how, "c.bin", len(data)) == data
        s = vol.stats()
        assert s["integrity_failures"] == 1 and s["misses"] == 3 and s["hits"] == 1
        # evicted through the daemon, then refilled with a good block
        settle(vol, daemon)
        vk = load_key_file(key_file)
        wait_for(lambda: os.path.exists(path) and
                 _opens(key, open(path, "rb").read(), vk), what="the refilled block")
        assert _read_via(vol, how, "c.bin", len(data)) == data
        assert vol.stats()["integrity_failures"] == 1


def _opens(key, blob, vk) -> bool:
    try:
        unseal(key, blob, vk)
        return True
    except IntegrityError:
        return False


def test_another_volume_key_cannot_read_the_block(local_source, key_file, daemon, tmp_path):
    data = random.Random(6).randbytes(2 * BS)
    local_source.write("s.bin", data)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        fill(vol, daemon, "s.bin", data)
        key, path = cached_block_path(vol, daemon, "s.bin")
        blob = open(path, "rb").read()
    other_key = str(tmp_path / "other.key")
    generate_key_file(other_key)
    with pytest.raises(IntegrityError):
        unseal(key, blob, load_key_file(other_key))
    # a reader with the other key under the same volume name names its blocks
    # with its own key: the owner's block is not even looked at (a miss, not
    # an integrity failure), and stays cached
    with volume(local_source, other_key, daemon, memory_cache_bytes=0) as intruder:
        wait_connected(intruder)
        assert intruder.read("s.bin", 0, BS) == data[:BS]
        s = intruder.stats()
        assert s["integrity_failures"] == 0 and s["hits"] == 0 and s["misses"] == 1
    assert open(path, "rb").read() == blob


def _read_in_child(args):
    source_url, key_file, sock, rel = args
    with Volume("vol", source_url, key_file, socket_path=sock, block_size=BS) as vol:
        for _ in range(200):
            if vol.stats()["daemon_connected"]:
                break
            import time
            time.sleep(0.02)
        data = vol.read(rel, 0, 1 << 30)
        vol.wait_fills(10)
        return hashlib.sha256(data).hexdigest(), vol.stats()


def test_two_processes_same_cold_file_one_copy_cached(local_source, key_file, daemon):
    data = random.Random(7).randbytes(4 * BS + 17)
    local_source.write("shared.bin", data)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.map(_read_in_child, [(local_source.url, key_file, daemon.socket_path,
                                             "shared.bin")] * 2)
    want = hashlib.sha256(data).hexdigest()
    assert [h for h, _ in results] == [want, want]
    assert all(s["daemon_connected"] and s["integrity_failures"] == 0 for _, s in results)
    stats = daemon.wait_idle()
    assert stats["entries"] == 5  # one copy of each block, however many readers filled it
    keys = daemon.client().list(volume="vol")["keys"]
    assert len(keys) == len(set(keys)) == 5


def test_fork_safety(source, key_file, daemon):
    rng = random.Random(8)
    files = {f"f{i}.bin": rng.randbytes(BS + 100 * i) for i in range(6)}
    for rel, data in files.items():
        source.write(rel, data)
    vol = volume(source, key_file, daemon)
    try:
        wait_connected(vol)
        assert vol.read("f0.bin", 0, 1 << 20) == files["f0.bin"]  # threads and queues now live
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()

        def child(names):
            try:
                connected = _eventually_connected(vol)  # its own new connection
                ok = all(vol.read(n, 0, 1 << 20) == files[n] for n in names)
                # the child's own filler thread and connection deliver its fills
                idle = vol.wait_fills(10)
                q.put((ok, connected, idle, vol.stats()["fills_sent"]))
            except BaseException as exc:  # report, never hang the parent
                q.put((False, repr(exc), False, 0))

        names = sorted(files)[1:]  # cold in the parent; each child fills its own share
        procs = [ctx.Process(target=child, args=(names[i::2],)) for i in range(2)]
        for p in procs:
            p.start()
        results = [q.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        # two blocks per file: 2 and 3 files
        assert sorted(results) == [(True, True, True, 4), (True, True, True, 6)], results
        daemon.wait_idle()
        assert daemon.client().stats()["entries"] == 11
        for n, data in files.items():  # the parent still works after its children
            assert vol.read(n, 0, 1 << 20) == data
        settle(vol, daemon)
    finally:
        vol.close()


def _eventually_connected(vol) -> bool:
    import time
    for _ in range(250):
        if vol.stats()["daemon_connected"]:
            return True
        time.sleep(0.02)
    return False


def test_bad_input(local_source, key_file, tmp_path):
    local_source.write("d/x.bin", b"x" * 100)
    url = local_source.url
    with pytest.raises(ConfigError, match="does not exist"):
        Volume("vol", url, str(tmp_path / "missing.key"))
    loose = tmp_path / "loose.key"
    generate_key_file(str(loose))
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match="chmod 0400"):
        Volume("vol", url, str(loose))
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        Volume("vol", str(tmp_path / "no-such-dir"), key_file)
    with pytest.raises(NotADirectoryError):
        Volume("vol", str(tmp_path / "src" / "d" / "x.bin"), key_file)
    with pytest.raises(ValueError, match="volume name"):
        Volume("Bad_Name", url, key_file)
    with pytest.raises(ConfigError, match="block size"):
        Volume("vol", url, key_file, block_size=100)
    with Volume("vol", url, key_file, socket_path=str(tmp_path / "none.sock")) as vol:
        for bad in ("../etc/passwd", "d/../../x", "d/./x.bin", "a\0b"):
            with pytest.raises(OSError) as e:
                vol.read(bad, 0, 1)
            assert e.value.errno == errno.EINVAL
            assert "escape" in str(e.value) or "NUL" in str(e.value)
        with pytest.raises(OSError) as e:
            vol.stat("../x")
        assert e.value.errno == errno.EINVAL
        for off, size in ((-1, 1), (0, -1), (2**63, 1)):
            with pytest.raises(OSError) as e:
                vol.read("d/x.bin", off, size)
            assert e.value.errno == errno.EINVAL and "d/x.bin" in str(e.value)
        with pytest.raises(TypeError):
            vol.read("d/x.bin", 1.5, 1)
        with pytest.raises(FileNotFoundError) as e:
            vol.read("d/nope.bin", 0, 1)
        assert e.value.errno == errno.ENOENT and "d/nope.bin" in str(e.value)
        with pytest.raises(IsADirectoryError) as e:
            vol.read("d", 0, 1)
        assert e.value.errno == errno.EISDIR
        with pytest.raises(NotADirectoryError):
            vol.listdir("d/x.bin")
        with pytest.raises(OSError) as e:
            vol.readlink("d/x.bin")
        assert e.value.errno == errno.EINVAL
        with pytest.raises(OSError) as e:  # a pinned info must be for the same path
            vol.read("d/x.bin", 0, 1, info=vol.stat("d"))
        assert e.value.errno == errno.EINVAL
    with pytest.raises(ValueError, match="closed"):
        vol.read("d/x.bin", 0, 1)


def test_readlink(local_source, key_file, tmp_path):
    local_source.write("t/target.bin", b"abc")
    os.symlink("target.bin", os.path.join(local_source.root, "t", "link"))
    with Volume("vol", local_source.url, key_file, socket_path=str(tmp_path / "none.sock")) as vol:
        assert vol.readlink("t/link") == "target.bin"
        entries = {f.name: f for f in vol.listdir("t")}
        assert entries["link"].is_link and not entries["target.bin"].is_link


def test_same_size_rewrite_of_a_multi_block_file_is_estale(source, key_file, daemon):
    old = random.Random(11).randbytes(3 * BS)
    new = random.Random(12).randbytes(3 * BS)
    source.write("m.bin", old)
    with volume(source, key_file, daemon) as vol:
        wait_connected(vol)
        pinned = vol.stat("m.bin")
        assert vol.read("m.bin", 0, 10, info=pinned) == old[:10]
        source.write("m.bin", new)  # same size: only the version differs
        with pytest.raises(OSError) as e:
            vol.read("m.bin", 2 * BS, 10, info=pinned)
        assert e.value.errno == errno.ESTALE and "m.bin" in str(e.value)
        # nothing of the new content was cached under the old version's keys
        assert vol.read("m.bin", 0, 10, info=pinned) == old[:10]
        assert vol.cached_bytes("m.bin", info=pinned) <= BS
        fresh = vol.stat("m.bin", max_age=0)
        assert vol.read("m.bin", 0, 3 * BS, info=fresh) == new


def test_unhealthy_dir_follows_the_layout_epoch(local_source, key_file, daemon):
    rng = random.Random(13)
    files = {f"h{i}.bin": rng.randbytes(1000 + i) for i in range(6)}
    for rel, data in files.items():
        local_source.write(rel, data)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        fill(vol, daemon, "h0.bin", files["h0.bin"])
        epoch = vol.stats()["layout_epoch"]
        blocks = os.path.join(daemon.cache_dirs[0], "blocks")
        os.rename(blocks, blocks + ".away")
        open(blocks, "wb").close()  # a file where the dir was: the daemon's writes fail
        try:
            for rel in ("h1.bin", "h2.bin", "h3.bin"):  # their fills fail: the dir goes out
                assert vol.read(rel, 0, 1 << 20) == files[rel]
                vol.wait_fills(10)
            wait_for(lambda: vol.stats()["layout_epoch"] != epoch, what="the new layout epoch")
            assert not vol._link.layout.dirs[0].healthy
            before = vol.stats()
            assert vol.read("h0.bin", 0, 1 << 20) == files["h0.bin"]  # a miss, not an error
            after = vol.stats()
            assert after["misses"] == before["misses"] + 1
            assert after["integrity_failures"] == 0
        finally:
            os.unlink(blocks)
            os.rename(blocks + ".away", blocks)
        # the daemon's probe brings the dir back; the reader follows the epoch
        wait_for(lambda: vol._link.layout is not None and vol._link.layout.dirs[0].healthy,
                 timeout=15, what="the dir to come back")
        before = vol.stats()
        assert vol.read("h0.bin", 0, 1 << 20) == files["h0.bin"]
        assert vol.stats()["hits"] == before["hits"] + 1


def test_hung_daemon_never_blocks_reads(local_source, key_file, daemon):
    """A daemon that stops answering (SIGSTOP) must not stall readers: hits
    need no round trip, misses hand their fills to a queue that drops."""
    import signal
    rng = random.Random(14)
    files = {f"s{i}.bin": rng.randbytes(2 * BS) for i in range(8)}
    for rel, data in files.items():
        local_source.write(rel, data)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0,
                fill_queue_bytes=4 * BS) as vol:
        fill(vol, daemon, "s0.bin", files["s0.bin"])
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            # if any of these waited for the daemon, the test would hang here
            # until pytest-timeout, since the daemon resumes only afterwards.
            # Fills go out posted (the socket's 4 MiB buffer takes ~4 rounds)
            # and then queue; once both are full they are dropped.
            for _ in range(20):
                for rel, data in files.items():
                    assert vol.read(rel, 0, len(data)) == data
                if vol.stats()["fills_dropped"]:
                    break
            assert vol.stats()["fills_dropped"] > 0  # the queue filled up and dropped
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: vol.stats()["daemon_connected"], what="the link to recover")
