"""`--shard I/N`: which files of a volume one of N hosts warms.

Cooperative warmup: the same command with `--shard 0/N` ... `--shard N-1/N`
on N hosts fetches every file from the remote once, on exactly one host; the
others later read it from the cluster tier. A file belongs to one shard by
its volume path alone (not the mount point, host or run), so every host
agrees without talking to the others, and a rerun warms the same files.

The shard of a path is a jump consistent hash (Lamping & Veach 2014) of the
path's BLAKE2b digest: even shares, and going from N to N+1 hosts moves only
1/(N+1) of the files. Both are fixed algorithms, so hosts on different
versions of fsclient still agree (tests/fsclient/warmup/test_shard.py pins
known answers).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_SHARD = re.compile(r"(\d+)/(\d+)")
_MASK64 = (1 << 64) - 1
_JUMP_MULTIPLIER = 2862933555777941757   # the paper's 64-bit LCG


def jump_hash(key: int, buckets: int) -> int:
    """The bucket in [0, buckets) of a 64-bit key (jump consistent hash)."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * _JUMP_MULTIPLIER + 1) & _MASK64
        j = int((b + 1) * ((1 << 31) / ((key >> 33) + 1)))
    return b


def path_key(path: str) -> int:
    """A 64-bit key of a volume path (names that are not UTF-8 keep their bytes)."""
    digest = hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0 <= index < count)."""

    index: int
    count: int

    def owns(self, path: str) -> bool:
        """Whether the file at volume path `path` is this shard's to warm."""
        return self.count == 1 or jump_hash(path_key(path), self.count) == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """`I/N` -> Shard; ValueError naming the problem and the expected form."""
    m = _SHARD.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not I/N: give this host's shard number and the "
                         f"number of hosts, e.g. 0/3 (shards are numbered from 0)")
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1:
        raise ValueError(f"{text!r}: N (the number of hosts) must be at least 1")
    if index >= count:
        raise ValueError(f"{text!r}: I must be 0 to {count - 1} (shards are numbered "
                         f"from 0, so the last of {count} hosts is {count - 1}/{count})")
    return Shard(index, count)
