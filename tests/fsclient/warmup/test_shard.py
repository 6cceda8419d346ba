"""`--shard I/N`: the shard of a path is fixed (hosts on any version agree),
even, moves little when hosts are added, and bad values are refused clearly.
The CLI over a real daemon: tests/operations/test_warmup_shards.py."""

from __future__ import annotations

import pytest

from fsclient.warmup.shard import Shard, jump_hash, parse_shard, path_key

# The reference vectors of jump consistent hash (the paper's C++ code, as
# every port tests it): a different answer means hosts would disagree.
JUMP_VECTORS = [(1, 1, 0), (42, 57, 43), (0xDEAD10CC, 1, 0), (0xDEAD10CC, 666, 361),
                (256, 1024, 520), (1, 128, 55), (129, 128, 120), (2**64 - 1, 128, 92)]


@pytest.mark.parametrize("key,buckets,expected", JUMP_VECTORS)
def test_jump_hash_reference_vectors(key, buckets, expected):
    assert jump_hash(key, buckets) == expected


def test_a_paths_shard_is_pinned():
    # BLAKE2b-64 of the UTF-8 path, big-endian; these must never change
    assert path_key("train/000.jpg") == 196994764370209934
    owners = {p: [i for i in range(3) if Shard(i, 3).owns(p)]
              for p in ("train/000.jpg", "dir0/sub/f1.bin", "")}
    assert owners == {"train/000.jpg": [0], "dir0/sub/f1.bin": [1], "": [2]}


def test_every_path_in_exactly_one_shard_and_shares_even():
    paths = [f"d{i % 17}/file-{i}.bin" for i in range(6000)]
    counts = [0, 0, 0]
    for p in paths:
        owners = [i for i in range(3) if Shard(i, 3).owns(p)]
        assert len(owners) == 1, p
        counts[owners[0]] += 1
    assert all(1800 <= c <= 2200 for c in counts), counts  # 2000 each, within 10%


def test_adding_a_host_moves_files_only_to_it():
    paths = [f"train/{i:05d}.jpg" for i in range(4000)]
    before = {p: jump_hash(path_key(p), 3) for p in paths}
    after = {p: jump_hash(path_key(p), 4) for p in paths}
    moved = [p for p in paths if before[p] != after[p]]
    assert all(after[p] == 3 for p in moved)   # never between the old hosts
    assert 800 <= len(moved) <= 1200            # about a quarter


def test_one_shard_owns_everything():
    assert Shard(0, 1).owns("anything") and Shard(0, 1).owns("")


def test_names_that_are_not_utf8_have_a_shard():
    name = b"caf\xe9.bin".decode("utf-8", "surrogateescape")
    assert sum(Shard(i, 2).owns(name) for i in range(2)) == 1


@pytest.mark.parametrize("text,shard", [("0/3", Shard(0, 3)), ("2/3", Shard(2, 3)),
                                        (" 1/2 ", Shard(1, 2)), ("0/1", Shard(0, 1))])
def test_parse_shard(text, shard):
    assert parse_shard(text) == shard
    assert str(shard) == text.strip()


@pytest.mark.parametrize("text,message", [
    ("3/3", "I must be 0 to 2"),
    ("5/3", "I must be 0 to 2"),
    ("1/0", "N (the number of hosts) must be at least 1"),
    ("-1/3", "is not I/N"),
    ("1", "is not I/N"),
    ("1/3/4", "is not I/N"),
    ("a/b", "is not I/N"),
    ("", "is not I/N"),
    ("$(JOB_COMPLETION_INDEX)/3", "is not I/N"),
])
def test_bad_shards_are_refused_with_the_reason(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_shard(text)
