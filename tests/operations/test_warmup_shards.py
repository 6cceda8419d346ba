"""`fsclient warmup --shard I/N` through the real CLI and a real blockcached:
N hosts' shards split a dataset, each file to exactly one of them."""

from __future__ import annotations

import random
import re

import pytest

from blockcache_client.contract.blockkey import KeyNamer
from blockcache_client.volumekey import load_key_file
from fsclient.warmup.shard import Shard
from tests.support.cli_runs import BLOCK, VOLUME, blocks_of, run_cli, warmup_args

N = 3


@pytest.fixture
def dataset(tmp_path):
    """45 files of 1 byte to 3 blocks in nested dirs: every file has a block,
    so the daemon's keys show which files a run fetched."""
    root = tmp_path / "remote"
    rng = random.Random(20)
    files = {}
    for i in range(45):
        rel = f"part{i % 4}/{'deep/' if i % 3 == 0 else ''}f{i:02d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        size = rng.randint(1, 2 * BLOCK + 5)
        (root / rel).write_bytes(rng.randbytes(size))
        files[rel] = size
    return root, files


def fetched_files(daemon, key_file, files) -> set[str]:
    """The files that have blocks in the daemon (its keys name the inode)."""
    daemon.wait_idle()
    names = KeyNamer(load_key_file(str(key_file)))
    by_prefix = {f"{VOLUME}_{names.inode(p)}_": p for p in files}
    found = set()
    for key in daemon.client().list_all(VOLUME):
        found |= {p for prefix, p in by_prefix.items() if key.startswith(prefix)}
    return found


def warm_shard(root, key_file, daemon, files, i: int) -> set[str]:
    """Run shard i of N on an empty cache; the files it fetched, then evict them."""
    assert not fetched_files(daemon, key_file, files)
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "--shard", f"{i}/{N}"))
    assert r.returncode == 0, r.stdout + r.stderr
    got = fetched_files(daemon, key_file, files)
    head = re.search(rf"^warmup of shard {i}/{N} done in [\d.]+s: (\d+) files", r.stdout, re.M)
    assert head and int(head.group(1)) == len(got), r.stdout
    nblocks = sum(blocks_of(files[p]) for p in got)
    assert f"({nblocks} blocks" in r.stdout, r.stdout
    other = re.search(r"other shards +(\d+) files", r.stdout)
    assert other and int(other.group(1)) == len(files) - len(got), r.stdout
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "--evict"))
    assert r.returncode == 0, r.stdout + r.stderr
    return got


def test_shards_cover_every_file_once_and_stay_put(daemon, dataset, key_file):
    root, files = dataset
    daemon.wait_rebuilt()
    shards = [warm_shard(root, key_file, daemon, files, i) for i in range(N)]
    assert set().union(*shards) == set(files)                  # nothing left out
    for a in range(N):
        for b in range(a + 1, N):
            assert not shards[a] & shards[b], (a, b)           # nothing fetched twice
    assert all(shards), [len(s) for s in shards]               # every host has work
    # Stable: the same files on a rerun, and as the module computes them (so
    # hosts that never talk to each other agree).
    assert warm_shard(root, key_file, daemon, files, 1) == shards[1]
    for i in range(N):
        assert shards[i] == {p for p in files if Shard(i, N).owns(p)}


def test_a_shard_of_a_file_list(daemon, dataset, key_file, tmp_path):
    """Given paths (here a file list) are split the same way as a walk."""
    root, files = dataset
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in sorted(files)))
    daemon.wait_rebuilt()
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "-f", str(listing),
                                             "--shard", f"2/{N}"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert fetched_files(daemon, key_file, files) == {p for p in files
                                                      if Shard(2, N).owns(p)}


@pytest.mark.parametrize("value,message", [
    ("3/3", "I must be 0 to 2"),
    ("1/0", "N (the number of hosts) must be at least 1"),
    ("two/3", "is not I/N"),
])
def test_bad_shard_values_are_usage_errors(daemon, dataset, key_file, value, message):
    root, _ = dataset
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "--shard", value))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Invalid value for '--shard'" in r.stderr and message in r.stderr, r.stderr
    assert not daemon.client().list_all(VOLUME)


def test_shard_is_refused_with_check_and_evict(daemon, dataset, key_file):
    root, _ = dataset
    for mode in ("--check", "--evict"):
        r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, mode, "--shard", "0/2"))
        assert r.returncode == 2, r.stdout + r.stderr
        assert "--shard only applies to warming" in r.stderr, r.stderr
