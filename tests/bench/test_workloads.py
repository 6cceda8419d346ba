"""A workload run yields cold and warm rows whose counters tell a cache from no cache."""

import dataclasses
import os

import pytest

from bench import datasets
from bench.systems import FsspecCache, LocalSystem, PassthroughSystem, S3fsDirect
from bench.workloads import Runner
from tests.support.pagecache import UNDEFERRED, nowait_read_defers


@pytest.fixture(autouse=True)
def _every_epoch_short(monkeypatch):
    """Whether a warm epoch is repeated (workload 1) or a round is (workload
    5) depends on how long it took; here no epoch counts as long, however
    loaded the machine, unless a test sets LONG_EPOCH_S itself."""
    import bench.workloads as workloads
    monkeypatch.setattr(workloads, "LONG_EPOCH_S", 3600.0)


def test_small_files_rows_show_the_cache_working(bench_ctx):
    # Two readers only (not 1 and 2): the split over processes is what matters here.
    ctx = dataclasses.replace(bench_ctx, size=dataclasses.replace(bench_ctx.size, readers=(2,)))
    runner = Runner(ctx, drop_caches=False, timeout=60)
    for system in (FsspecCache("simplecache"), S3fsDirect(), LocalSystem()):
        runner.small_files(system)
    assert not runner.errors, runner.errors
    rows = {(r["system"], r["config"], r["epoch"]): r for r in runner.rows}
    files = bench_ctx.size.files
    for config in ("2 readers",):
        cold = rows[("fsspec-simplecache", config, 1)]
        warm = rows[("fsspec-simplecache", config, 2)]
        assert cold["items"] == warm["items"] == files
        assert cold["remote_requests"] >= files and warm["remote_requests"] == 0
        assert warm["cache_bytes"] >= cold["bytes"]
        # Without a cache every epoch goes to the remote.
        assert rows[("s3fs", config, 2)]["remote_requests"] >= files
        assert rows[("local", config, 1)]["remote_requests"] == 0
    for r in runner.rows:
        assert r["bytes"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 and r["cpu_s"] >= 0
    # Warm epochs are repeated while short (test_long_warm_epochs_are_not_repeated).
    assert ("fsspec-simplecache", "2 readers", 3) in rows
    assert ("local", "2 readers", 3) in rows


def test_long_warm_epochs_are_not_repeated(bench_ctx, monkeypatch):
    import bench.workloads as workloads

    monkeypatch.setattr(workloads, "LONG_EPOCH_S", 0.0)
    ctx = dataclasses.replace(bench_ctx, size=dataclasses.replace(bench_ctx.size, readers=(1,)))
    runner = Runner(ctx, drop_caches=False, timeout=60)
    runner.small_files(LocalSystem())
    assert not runner.errors, runner.errors
    assert [r["epoch"] for r in runner.rows] == [1, 2]


def test_metadata_rows_count_modules_and_stats(bench_ctx):
    runner = Runner(bench_ctx, drop_caches=False, timeout=60)
    runner.metadata(FsspecCache("simplecache"))
    runner.metadata(LocalSystem())
    assert not runner.errors, runner.errors
    modules = len(datasets.module_names(bench_ctx.size))
    for r in runner.rows:
        want = modules if r["config"] == "import" else bench_ctx.size.files
        assert r["items"] == want, r


def test_warm_epochs_start_with_the_backing_files_in_the_page_cache(bench_ctx, monkeypatch):
    """Before each warm epoch (never a cold one) the runner reads the system's
    backing files into the host page cache: the local copy for local disk."""
    import bench.workloads as workloads

    warmed = []
    real = workloads.read_into_page_cache
    monkeypatch.setattr(workloads, "read_into_page_cache",
                        lambda dirs: warmed.append(list(dirs)) or real(dirs))
    ctx = dataclasses.replace(bench_ctx, size=dataclasses.replace(bench_ctx.size, readers=(1,)))
    runner = Runner(ctx, drop_caches=False, timeout=60)
    runner.small_files(LocalSystem())
    assert not runner.errors, runner.errors
    # tiny: two warm epochs, since they are short
    assert [r["epoch"] for r in runner.rows] == [1, 2, 3]
    assert warmed == [[bench_ctx.local_root]] * 2  # before epochs 2 and 3, not 1
    runner = Runner(ctx, drop_caches=False, warm_host_cache=False, timeout=60)
    warmed.clear()
    runner.small_files(LocalSystem())
    assert warmed == []


def test_read_into_page_cache_brings_dropped_pages_back(tmp_path):
    """The pages of a file the kernel dropped are in memory again afterwards
    (a read with RWF_NOWAIT, which never waits on the disk, then succeeds)."""
    from bench.systems import read_into_page_cache

    path = tmp_path / "d" / "f.bin"
    path.parent.mkdir()
    path.write_bytes(os.urandom(1 << 20))
    try:
        defers = nowait_read_defers(str(path))
    except OSError:
        pytest.skip("no RWF_NOWAIT reads on this file system")
    if not defers:
        pytest.skip(UNDEFERRED)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(1 << 20)
        assert read_into_page_cache([str(tmp_path)]) == 1 << 20
        assert os.preadv(fd, [buf], 0, os.RWF_NOWAIT) == 1 << 20
    finally:
        os.close(fd)


def test_shared_rows_hold_new_clients_to_a_restarted_clients_warm_epoch(bench_ctx, monkeypatch):
    """Workload 5: client 0 cold, warm, then in each round warm again after a
    restart (from the cache alone, no remote requests) beside a new client's
    first epoch; a round of long epochs is not repeated."""
    import bench.workloads as workloads

    runner = Runner(bench_ctx, drop_caches=False, timeout=60)
    runner.shared(FsspecCache("simplecache"))
    assert not runner.errors, runner.errors
    got = [(r["epoch"], r["client"], r.get("round"), r["phase"]) for r in runner.rows]
    assert bench_ctx.size.shared_rounds == 2
    assert got == [(1, 0, None, "cold"), (2, 0, None, "warm"),
                   (3, 0, 0, "warm, restarted"), (1, 1, 0, "first epoch, new client"),
                   (3, 0, 1, "warm, restarted"), (1, 2, 1, "first epoch, new client")]
    files = bench_ctx.size.shared_files
    assert runner.rows[0]["remote_requests"] >= files
    for r in runner.rows[1:]:
        assert r["items"] == files and r["remote_requests"] == 0, r

    monkeypatch.setattr(workloads, "LONG_EPOCH_S", 0.0)
    runner = Runner(bench_ctx, drop_caches=False, timeout=60)
    runner.shared(FsspecCache("simplecache"))
    assert not runner.errors, runner.errors
    assert [r.get("round") for r in runner.rows] == [None, None, 0, 0]


def test_clients_measured_together_read_in_turns(bench_ctx, monkeypatch):
    """Workload 5's clients of a round take turns of SHARED_SLICE files, so
    each one's epoch spans the same stretch of the machine's time."""
    import bench.workloads as workloads
    from bench.worker import Workers

    calls = []
    real = Workers.run

    def run(self, cmd, args):
        if cmd == "files":
            calls.append((id(self), len(args[0])))
        return real(self, cmd, args)
    monkeypatch.setattr(Workers, "run", run)
    monkeypatch.setattr(workloads, "SHARED_SLICE", 5)
    runner = Runner(bench_ctx, drop_caches=False, timeout=60)
    runner.shared(FsspecCache("simplecache"))
    assert not runner.errors, runner.errors
    files = bench_ctx.size.shared_files   # 16: turns of 5, 5, 5 and 1
    rounds = calls[2:]                     # after client 0's epochs 1 and 2
    first = rounds[:8]
    assert [n for _, n in first] == [5, 5, 5, 5, 5, 5, 1, 1]
    assert len({w for w, _ in first[0::2]}) == 1 and first[0][0] != first[1][0]
    assert sum(n for _, n in first) == 2 * files
    for r in runner.rows[2:]:
        assert r["items"] == files


def test_restart_client_remounts_over_the_same_files(bench_ctx):
    """A restarted mount is a new FUSE server on the same mountpoint, reading the same files."""
    system = PassthroughSystem()
    if system.unavailable():
        pytest.skip(system.unavailable())
    system.start(bench_ctx, "restart")
    try:
        path = os.path.join(system.mounts[0].mountpoint, datasets.small_files(bench_ctx.size)[0])
        before = open(path, "rb").read()
        pid = system.mounts[0].proc.pid
        system.restart_client(0)
        assert system.mounts[0].proc.pid != pid and len(system.mounts) == 1
        assert open(path, "rb").read() == before and before
    finally:
        system.stop()


def test_posix_settle_waits_for_the_fuse_servers_fill_queue(tmp_path):
    """A mount's reader waits between epochs until the server's stats (an
    xattr on the mount's root) show no queued fill bytes."""
    import json
    import threading
    import time

    from bench.access_paths import PosixReader

    name = "user.blockcache.stats"
    os.setxattr(tmp_path, name, json.dumps({"fill_queue_bytes": 4 << 20}).encode())
    drained = threading.Timer(0.3, lambda: os.setxattr(
        tmp_path, name, json.dumps({"fill_queue_bytes": 0}).encode()))
    drained.start()
    try:
        t0 = time.monotonic()
        PosixReader(str(tmp_path), xattr_stats=name).settle()
        assert time.monotonic() - t0 >= 0.25
    finally:
        drained.cancel()
    PosixReader(str(tmp_path)).settle()  # no stats (local disk): nothing to wait for
