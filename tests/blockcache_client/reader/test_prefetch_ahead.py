"""`prefetch_ahead` against a real daemon: readers elsewhere hit, and it stays bounded.

The source is `latency::` over a local dir (devtools/latencyfs.py), which
counts the requests it gets and how many were in flight at once.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import random
import threading
import time

import fsspec
import pytest

import devtools.latencyfs  # noqa: F401  (registers latency::)
from blockcache_client import Volume, prefetch_ahead
from blockcache_client.reader.ahead import hostfill
from tests.support.waiting import wait_for

BS = 64 << 10
DELAY = 0.01


def make_files(root, n: int, seed: int = 3) -> dict[str, bytes]:
    """n files in two dirs, a few of them several blocks long."""
    rng = random.Random(seed)
    files = {}
    for i in range(n):
        rel = f"d{i % 2}/f{i:04d}.bin"
        files[rel] = rng.randbytes(3 * BS + 17 if i % 7 == 0 else rng.randint(1, BS))
        os.makedirs(os.path.join(root, f"d{i % 2}"), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(files[rel])
    return files


def slow_source(root, delay: float = DELAY):
    return fsspec.filesystem("latency", target_protocol="file", delay=delay), str(root)


def open_volume(root, key_file, socket_path, fs=None, **kw) -> Volume:
    kw.setdefault("block_size", BS)
    if fs is not None:
        kw["fs"] = fs
    vol = Volume("vol", str(root), key_file, socket_path=socket_path, **kw)
    if os.path.exists(socket_path):
        wait_for(lambda: vol.stats()["daemon_connected"], what="the volume to reach the daemon")
    return vol


def _read_in_worker(root: str, key_file: str, socket_path: str,
                    files: dict[str, bytes]) -> dict:
    """A DataLoader worker: its own Volume in its own process, straight on the
    local dir (same name, key and block size: the same block keys)."""
    vol = open_volume(root, key_file, socket_path)
    try:
        for rel, data in files.items():
            assert vol.read(rel, 0, len(data) + 1) == data, rel
        return vol.stats()
    finally:
        vol.close()


def read_in_another_process(root, key_file, socket_path, files) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_read_in_worker, (str(root), key_file, socket_path, files))


def ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("blockcache-ahead")]


def test_workers_in_another_process_hit_every_block(tmp_path, key_file, daemon):
    root = tmp_path / "remote"
    files = make_files(root, 40)
    paths = sorted(files)
    random.Random(1).shuffle(paths)
    fs, src = slow_source(root)
    with open_volume(src, key_file, daemon.socket_path, fs=fs) as vol:
        it = prefetch_ahead(vol, paths, depth=8)
        yielded = []
        for rel in it:
            # yielded once every block is on the cache disk, not merely queued
            assert vol.cached_bytes(rel) == len(files[rel]), rel
            yielded.append(rel)
        assert yielded == paths  # in order, every one
        stats = it.stats()
    assert (stats["files"], stats["filled"], stats["failed"], stats["dropped"]) == (40, 40, 0, 0)
    # no wait for fills here: a yielded path is in the host cache already
    got = read_in_another_process(root, key_file, daemon.socket_path, files)
    blocks = sum(-(-len(d) // BS) for d in files.values())
    assert (got["hits"], got["misses"], got["backend_bytes"]) == (blocks, 0, 0), got


def test_requests_in_flight_never_exceed_depth(tmp_path, key_file, daemon):
    root = tmp_path / "remote"
    files = make_files(root, 60)
    fs, src = slow_source(root, delay=0.02)
    with open_volume(src, key_file, daemon.socket_path, fs=fs) as vol:
        it = prefetch_ahead(vol, sorted(files), depth=5)
        for _ in it:
            assert len(ahead_threads()) <= 5
        assert fs.reads >= 60
        # bounded by depth, and really parallel (not one file at a time)
        assert 2 <= fs.max_in_flight <= 5, fs.max_in_flight
        assert 2 <= it.stats()["max_requests"] <= 5


def test_requests_run_on_the_fill_threads_not_the_backends_pool(tmp_path, key_file, daemon):
    # a backend pool of 2 threads: the fills' source requests do not queue
    # behind it, so depth alone bounds them
    root = tmp_path / "remote"
    files = make_files(root, 40)
    fs, src = slow_source(root, delay=0.02)
    with open_volume(src, key_file, daemon.socket_path, fs=fs, workers=2) as vol:
        it = prefetch_ahead(vol, sorted(files), depth=8)
        assert list(it) == sorted(files)
        assert it.stats()["filled"] == 40
    assert 2 < fs.max_in_flight <= 8, fs.max_in_flight


def test_a_hung_source_holds_the_consumer_no_longer_than_its_retry_budget(
        tmp_path, key_file, daemon, monkeypatch):
    monkeypatch.setattr(hostfill, "PUT_TIMEOUT", 0.2)
    root = tmp_path / "remote"
    files = make_files(root, 3)
    fs, src = slow_source(root)
    with open_volume(src, key_file, daemon.socket_path, fs=fs, timeout=0.2, attempts=1) as vol:
        for rel in files:
            vol.stat(rel)  # the metadata is held: only the reads hang
        fs.delay = 3.0
        t0 = time.monotonic()
        with prefetch_ahead(vol, sorted(files), depth=3) as it:
            assert list(it) == sorted(files)  # each yielded after patience (0.4 s)
            stats = it.stats()
        assert time.monotonic() - t0 < 2.5
        assert stats["failed"] == 3, stats


def test_bytes_held_stay_within_max_bytes(tmp_path, key_file, daemon):
    root = tmp_path / "remote"
    os.makedirs(root)
    paths = [f"f{i}.bin" for i in range(20)]
    for rel in paths:
        (root / rel).write_bytes(os.urandom(BS))
    fs, src = slow_source(root)
    with open_volume(src, key_file, daemon.socket_path, fs=fs) as vol:
        # room for one block (plaintext and sealed) at a time, whatever the depth
        it = prefetch_ahead(vol, paths, depth=8, max_bytes=2 * BS)
        assert list(it) == paths
        stats = it.stats()
    assert stats["filled"] == 20
    assert stats["max_requests"] == 1 and 0 < stats["peak_bytes"] <= 2 * BS, stats


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_consumer_that_stops_leaves_at_most_depth_more_fetched(how, tmp_path, key_file,
                                                                daemon):
    root = tmp_path / "remote"
    files = {rel: d for rel, d in make_files(root, 120).items() if len(d) <= BS}
    depth, k = 6, 10
    fs, src = slow_source(root)
    with open_volume(src, key_file, daemon.socket_path, fs=fs) as vol:
        it = prefetch_ahead(vol, sorted(files), depth=depth)
        for i, _ in enumerate(it):
            if i + 1 == k:
                break
        if how == "close":
            it.close()
        else:
            del it
            gc.collect()
        wait_for(lambda: not ahead_threads(), what="the prefetch threads to end")
        reads = fs.reads
        time.sleep(0.3)
        assert fs.reads == reads  # nothing more after it stopped
        assert k <= reads <= k + depth, reads


def test_cached_files_cost_no_remote_request(tmp_path, key_file, daemon):
    root = tmp_path / "remote"
    files = make_files(root, 20)
    fs, src = slow_source(root)
    with open_volume(src, key_file, daemon.socket_path, fs=fs) as vol:
        assert len(list(prefetch_ahead(vol, sorted(files)))) == 20
        before = fs.requests
        again = prefetch_ahead(vol, sorted(files))
        assert len(list(again)) == 20
        assert fs.requests == before  # metadata held, every block found on the cache disk
        assert again.stats()["cached"] == 20
    fs2, _ = slow_source(root)
    with open_volume(src, key_file, daemon.socket_path, fs=fs2) as fresh:
        third = prefetch_ahead(fresh, sorted(files))
        assert len(list(third)) == 20
        assert fs2.reads == 0  # a new process pays its metadata only
        assert third.stats()["cached"] == 20


def test_a_failing_path_is_yielded_and_its_read_raises(tmp_path, key_file, daemon):
    root = tmp_path / "remote"
    files = make_files(root, 6)
    paths = sorted(files)
    gone = paths[2]
    os.unlink(os.path.join(root, gone))
    fs, src = slow_source(root)
    with open_volume(src, key_file, daemon.socket_path, fs=fs) as vol:
        it = prefetch_ahead(vol, [*paths, "no/such/dir/file.bin"], depth=3)
        assert list(it) == [*paths, "no/such/dir/file.bin"]
        stats = it.stats()
        assert (stats["filled"], stats["failed"]) == (5, 2), stats
        with pytest.raises(FileNotFoundError, match=gone):
            vol.read(gone, 0, 10)
    del files[gone]
    got = read_in_another_process(root, key_file, daemon.socket_path, files)
    assert got["backend_bytes"] == 0


def test_a_sampler_of_indices_with_path_of(tmp_path, key_file, daemon):
    root = tmp_path / "remote"
    files = make_files(root, 12)
    paths = sorted(files)
    order = [7, 3, 11, 0, 5]
    fs, src = slow_source(root)
    with open_volume(src, key_file, daemon.socket_path, fs=fs) as vol:
        it = prefetch_ahead(vol, iter(order), depth=2, path_of=paths.__getitem__)
        assert list(it) == order
        assert it.stats()["filled"] == 5
        # every block of those five files is on the cache disk now, the others not
        for i, rel in enumerate(paths):
            assert vol.cached_bytes(rel) == (len(files[rel]) if i in order else 0), rel


def test_without_a_daemon_items_pass_straight_through(tmp_path, key_file):
    root = tmp_path / "remote"
    files = make_files(root, 5)
    fs, src = slow_source(root)
    with open_volume(src, key_file, str(tmp_path / "none.sock"), fs=fs) as vol:
        it = prefetch_ahead(vol, sorted(files))
        assert list(it) == sorted(files)
        assert it.stats()["no_daemon"] == 5 and fs.reads == 0


def test_misuse_is_named(tmp_path, key_file):
    root = tmp_path / "remote"
    make_files(root, 2)
    with open_volume(str(root), key_file, str(tmp_path / "none.sock")) as vol:
        with pytest.raises(ValueError, match="depth must be a positive integer"):
            prefetch_ahead(vol, [], depth=0)
        with pytest.raises(ValueError, match="max_bytes"):
            prefetch_ahead(vol, [], max_bytes=-1)
        with pytest.raises(TypeError, match="must be a blockcache_client.Volume"):
            prefetch_ahead("vol", [])
        with pytest.raises(TypeError, match="pass path_of="):
            list(prefetch_ahead(vol, [0, 1]))
        with pytest.raises(TypeError, match=r"path_of\(0\) returned 0 \(int\)"):
            list(prefetch_ahead(vol, [0], path_of=lambda i: i))
    assert not ahead_threads()
