"""A workload run yields cold and warm rows whose counters tell a cache from no cache."""

import dataclasses

from bench.systems import FsspecCache, LocalSystem, S3fsDirect
from bench.workloads import Runner


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


def test_metadata_rows_count_modules_and_stats(bench_ctx):
    runner = Runner(bench_ctx, drop_caches=False, timeout=60)
    runner.metadata(FsspecCache("simplecache"))
    runner.metadata(LocalSystem())
    assert not runner.errors, runner.errors
    from bench import datasets
    modules = len(datasets.module_names(bench_ctx.size))
    for r in runner.rows:
        want = modules if r["config"] == "import" else bench_ctx.size.files
        assert r["items"] == want, r
