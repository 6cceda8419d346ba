"""`bench.large_files` runs whole at a small size: every system reads the exact bytes
asked for, the model loads with every tensor (mapped, or read then loaded), the remote
counts what it sent, and the figures it prints are computed."""

import math
import os

import pytest

from bench import large_files, model_load, model_runs
from bench.datasets import MIB
from bench.systems import Ctx, VolumeSystem, retire

# every model row of one round: (key, readers, loaded by mmap, cold)
MODEL_ROWS = [("local dropped", 1, True, False), ("local cached", 1, True, False),
              ("fuse cold", 1, True, True), ("fuse warm", 1, True, False),
              ("volume cold", 1, False, True), ("volume warm", 1, False, False),
              ("crt cold", 1, False, True), ("fuse cold x4", 4, True, True),
              ("fuse cold x8", 8, True, True), ("local cached x4", 4, True, False),
              ("local cached x8", 8, True, False)]


def test_large_files_small_run(tmp_path):
    args = large_files.parse_args([
        "--small-files", "5", "--small-kib", "16", "--large-files", "1", "--large-mib", "8",
        "--model-mib", "4", "--model-rounds", "1", "--model-readers", "4,8", "--repeat", "1",
        "--rounds", "1", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    result = large_files.run(args)
    rows = {r["case"]: r for r in result["rows"]}
    # every system's caches were removed once the run ended
    assert sorted(os.listdir(tmp_path / "work")) == ["local", "moto.log"]
    for s in large_files.COLD_SYSTEMS:
        assert rows[f"cold small files {s}"]["bytes"] == 5 * 16 << 10
        assert rows[f"cold small files {s}"]["items"] == 5
        assert rows[f"cold large files {s}"]["bytes"] == 8 * MIB
    assert rows["warm large files volume readinto"]["bytes"] == 8 * MIB
    assert rows["warm large files volume read()"]["bytes"] == 8 * MIB
    assert rows["decrypt"]["parallel"] > 0 and rows["decrypt"]["one_thread"] > 0
    shapes = model_load.layout(4 * MIB)
    tensor_bytes = sum(2 * math.prod(shape) for _, shape in shapes)
    file_bytes = result["data"]["model_bytes"]
    assert result["data"]["tensors"] == len(shapes) and file_bytes > tensor_bytes
    for key, readers, mapped, cold in MODEL_ROWS:
        row = rows[f"model {key}"]
        # a mapped load copies each tensor out; a loaded one reads the whole file
        each = tensor_bytes if mapped else file_bytes
        assert (row["readers"], row["bytes"], row["items"]) == (
            readers, readers * each, readers * len(shapes)), key
        # the S3 server counted what it sent: each cold load fetched the file at
        # least once (GETs and their headers included); a warm one through a fresh
        # mount only the listing that finds the file, the local ones nothing
        if cold:
            assert 1.0 <= row["remote_vs_file"] <= 1.1 * readers, key
        else:
            assert row["remote_bytes"] < (16 << 10 if row["system"] != "local" else 1), key
    # the local file's page cache was dropped before its first load: read from the disk
    assert rows["model local dropped"]["disk_bytes"] >= file_bytes
    assert rows["model local cached"]["disk_bytes"] == 0
    figures = result["figures"]
    for _, key, _, _ in large_files.TARGETS:
        assert figures[key] > 0, key
    text = large_files.report(result["rows"], figures)
    for name, _, _, _ in large_files.TARGETS:
        assert name in text
    assert model_runs.HEADER in text and "fuse cold x8 (round 0)" in text
    assert "model x8 remote vs file" in text and "over 1 rounds" in text
    # the CPU a MiB of each load, and the bound it sets on the warm mapped load
    warm, local = rows["model fuse warm"], rows["model local dropped"]
    reader, server, _ = model_runs.ms_a_mib(warm)
    assert reader > 0 and server >= 0  # (the server's in /proc's 10 ms ticks)
    assert figures["model warm fuse cap vs local dropped"] == pytest.approx(
        model_runs.ms_a_mib(local)[0] / max(reader, (reader + server) / os.cpu_count()))
    assert "ms CPU a MiB (medians)" in text and "  fuse warm" in text
    # the bounds of the other targets: each load's CPU spread over every core,
    # the machine's busy time where it is more than its processes' (the
    # kernel's writeback of a cold load's fills is charged to none of them)
    def floor(row):
        spent = row["cpu_s"] + row["server_cpu_s"] + row["s3_cpu_s"]
        return max(spent, row["host_cpu_s"]) / os.cpu_count()
    one = rows["model fuse cold"]
    assert one["host_cpu_s"] >= one["cpu_s"] > 0
    assert figures["model cold fuse cap vs crt"] == pytest.approx(
        rows["model crt cold"]["seconds"] / floor(one))
    x8 = rows["model fuse cold x8"]
    assert figures["model x8 wall floor vs one reader"] == pytest.approx(
        floor(x8) / one["seconds"])
    assert figures["model x8 local wall vs one local"] == pytest.approx(
        rows["model local cached x8"]["seconds"] / rows["model local cached"]["seconds"])
    assert (f"wall time <= 1.3x one reader's: {figures['model x8 wall vs one reader']:.2f}x "
            f"({os.cpu_count()} CPUs allow no less than "
            f"{figures['model x8 wall floor vs one reader']:.2f}x; 8 loads from local disk: "
            f"{figures['model x8 local wall vs one local']:.2f}x one)") in text
    assert "decrypt, 1 thread" in text  # the yardstick is printed beside the warm row
    # each cold row's CPU, split by the reader's threads and the daemon's
    small, large = rows["cold small files volume"], rows["cold large files volume"]
    assert set(large["daemon_threads"]) == {"loop", "workers"}
    # (/proc counts 10 ms ticks: a thread of this tiny run may have none, and
    # is then left out; each thread's share is rounded on its own, so the
    # split may exceed the row's CPU by up to a tick a thread)
    # (the split itself, on a thread busy long enough to be counted, is
    # `test_systems.py::test_a_worker_splits_its_cpu_by_thread_name`)
    for row in (small, large):
        assert sum(row["threads"].values()) <= row["cpu_s"] + 0.011 * len(row["threads"])
    assert "ms CPU a file: reader" in text and "ms CPU a MiB: reader" in text
    assert "daemon" in large_files.per_item(large) and "S3" in large_files.per_item(large)
    assert f"decrypt, {rows['decrypt']['threads']} threads" in text
    # what became of the cold round's fills, and the warm epochs found them all
    fills = rows["fills"]
    assert fills["sent"] == fills["written"] == 5 + 2 and fills["dropped"] == 0
    # the large files' blocks went from fill area slots (a small file's fill goes
    # by value from the reading thread, or from a slot when the filler has it)
    assert 2 <= fills["by_slot"] <= fills["sent"]
    assert f"fills: reader sent 7 ({fills['by_slot']} from a fill area slot), dropped 0" in text
    assert rows["warm large files volume readinto"]["misses"] == 0
    assert "misses (blocks not in the cache): 0" in text


def test_model_layout_scales_with_size():
    """Many tensors at any size; about the size asked for."""
    small, big = model_load.layout(4 * MIB), model_load.layout(1024 * MIB)
    assert len(small) >= 8 and len(big) >= 300
    total = sum(2 * math.prod(shape) for _, shape in big)
    assert 0.9 * 1024 * MIB <= total <= 1.1 * 1024 * MIB


def test_a_stopped_systems_caches_stay_until_the_run_ends(tmp_path):
    """Removing a system's cache files as it stops would have the file system
    charge that work to the next system's epoch (see `systems.retire`)."""
    system = VolumeSystem()
    system.start(Ctx(None, str(tmp_path / "local"), str(tmp_path), None), "files0")
    kept = os.path.join(system.cache_dirs()[0], "a-cache-file")
    with open(kept, "wb") as f:
        f.write(b"x")
    spent: list[str] = []
    retire(system, spent)
    assert system.daemon is None  # stopped
    assert spent == [system.dir] and os.path.exists(kept)
