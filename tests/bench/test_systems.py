"""Every in-process system adapter (and local disk) reads the dataset's exact bytes.

FUSE-based systems are covered by tests/fsclient and by the suite itself;
here the in-process paths run in real reader processes against the real
moto server (and, for Volume, a real blockcached).
"""

import hashlib

import pytest

from bench import datasets
from bench.systems import all_systems
from bench.worker import Workers

IN_PROCESS = [s.name for s in all_systems() if s.kind != "mount"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("name", IN_PROCESS)
def test_adapter_reads_correct_bytes(bench_ctx, name):
    system = next(s for s in all_systems() if s.name == name)
    size = bench_ctx.size
    files = datasets.small_files(size)[:4]
    want = {p: _sha(datasets.expected_bytes(p, datasets.small_file_size(i)))
            for i, p in enumerate(files)}
    shard = datasets.shards(size)[0]
    whole = datasets.expected_bytes(shard, size.shard_bytes)
    ranges = [(shard, 0, 4096), (shard, 1 << 20, 128 << 10), (shard, size.shard_bytes - 100, 100)]
    system.start(bench_ctx, "smoke")
    try:
        with Workers(system.reader_spec(), 1, timeout=60) as w:
            for _ in range(2):          # cold, then from whatever the system cached
                assert w.run_all("digest", files)[1][0]["digests"] == want
                got = w.run_all("ranges_digest", ranges)[1][0]["digests"]
                assert got == [_sha(whole[o:o + n]) for _, o, n in ranges]
                w.run_all("settle", None)
                system.settle()
    finally:
        system.stop()


def test_bench_profile_writes_a_profile_per_command(tmp_path, monkeypatch):
    """BENCH_PROFILE=DIR: each worker command leaves a cProfile of itself."""
    import pstats

    root = tmp_path / "data"
    root.mkdir()
    (root / "a.bin").write_bytes(b"x" * 1000)
    out = tmp_path / "prof"
    monkeypatch.setenv("BENCH_PROFILE", str(out))
    with Workers({"type": "posix", "root": str(root)}, 1, timeout=60) as w:
        assert w.run_all("files", ["a.bin"])[1][0]["bytes"] == 1000
    [prof] = out.glob("*-files.pstats")
    funcs = {name for _, _, name in pstats.Stats(str(prof)).stats}
    assert "read_file" in funcs



def test_a_worker_splits_its_cpu_by_thread_name():
    """The per-thread CPU a cold row reports: live threads' CPU summed under
    their name without its number, and the spinning ones carry it."""
    import threading
    import time

    from bench import worker

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    spun, done = threading.Barrier(3), threading.Event()

    def busy() -> None:
        spin(0.1)
        spun.wait(10)
        done.wait(10)  # a thread that ended leaves /proc: stay until read

    threads = [threading.Thread(target=busy, name=f"blockcache-prefetch_{i}") for i in range(2)]
    try:
        for t in threads:
            t.start()
        spun.wait(10)
        split = worker._threads_cpu()
    finally:
        done.set()
        for t in threads:
            t.join(10)
    assert split["blockcache-prefetch"] >= 0.15  # two threads' 0.1 s, in 10 ms ticks
    assert "blockcache-prefetch_0" not in split and "MainThread" in split
