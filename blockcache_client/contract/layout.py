"""Where a block lives on disk, computable by any reader without asking.

    <cache_dir>/blocks/<xx>/<yy>/<key>     a complete, validated block file
    <cache_dir>/tmp/<anything>             in-flight writes, renamed into place

`xx/yy` are the first two bytes (hex) of a stable hash of the key string: 65,536
leaf dirs keep directories small at tens of millions of blocks. With several
cache dirs a key's dir is chosen by weighted rendezvous hashing over the dirs'
ids (their absolute paths) with their weights (capacities): every host and every
restart computes the same dir, and adding or removing a dir moves only the keys
that land on (or came from) that dir.

The daemon sends its layout in the `hello` reply as
`{"dirs": [{"path": str, "weight": int, "healthy": bool}, ...]}`; readers build
a `Layout` from it and open block files themselves on the hit path.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass

BLOCKS_DIR = "blocks"
TMP_DIR = "tmp"
LOCK_FILE = "blockcached.lock"


def _h64(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8, person=b"blockcache-lay")
    for p in parts:
        h.update(p)
        h.update(b"\0")
    return int.from_bytes(h.digest(), "big")


def fanout(key: str) -> str:
    """`xx/yy` for a key: stable across hosts, versions and restarts."""
    d = hashlib.blake2b(key.encode(), digest_size=2, person=b"blockcache-fan").hexdigest()
    return f"{d[:2]}/{d[2:]}"


def block_relpath(key: str) -> str:
    """Path of a key's block file relative to its cache dir."""
    return f"{BLOCKS_DIR}/{fanout(key)}/{key}"


def rendezvous_score(dir_id: str, weight: int, key: str) -> float:
    """Weighted rendezvous score: the dir with the highest score owns the key.

    -w / ln(u) with u uniform in (0, 1) gives each dir a share of keys
    proportional to its weight (Schindelhauer & Schomaker's weighted HRW).
    """
    u = (_h64(dir_id.encode(), key.encode()) + 1) / (2**64 + 1)
    return -weight / math.log(u)


@dataclass(frozen=True, slots=True)
class CacheDir:
    path: str      # absolute; also the dir's identity for placement
    weight: int    # relative share of keys (its capacity in bytes)
    healthy: bool = True


class Layout:
    """The set of cache dirs and the key -> file mapping over them."""

    __slots__ = ("dirs", "_blocks", "_only")

    def __init__(self, dirs: list[CacheDir]):
        if not dirs:
            raise ValueError("a layout needs at least one cache dir")
        self.dirs = tuple(dirs)
        # "<dir>/blocks/" of each dir: a reader builds a path per block it reads
        self._blocks = tuple(os.path.join(d.path, BLOCKS_DIR, "") for d in self.dirs)
        # the usual host: one healthy dir, whose paths `path` builds directly
        self._only = self._blocks[0] if len(self.dirs) == 1 and self.dirs[0].healthy else None

    def dir_index(self, key: str) -> int:
        """Index of the dir that owns `key` (health does not move keys)."""
        if len(self.dirs) == 1:
            return 0
        best, best_score = 0, -1.0
        for i, d in enumerate(self.dirs):
            s = rendezvous_score(d.path, d.weight, key)
            if s > best_score:
                best, best_score = i, s
        return best

    def path(self, key: str) -> str | None:
        """Absolute path of `key`'s block file, or None if its dir is unhealthy
        (an unhealthy dir's keys are misses: reading it could hang or fail)."""
        if self._only is not None:  # one healthy dir: no placement, no health check
            return f"{self._only}{fanout(key)}/{key}"
        i = self.dir_index(key) if len(self.dirs) > 1 else 0
        if not self.dirs[i].healthy:
            return None
        return f"{self._blocks[i]}{fanout(key)}/{key}"

    def to_wire(self) -> dict:
        return {"dirs": [{"path": d.path, "weight": d.weight, "healthy": d.healthy}
                         for d in self.dirs]}

    @classmethod
    def from_wire(cls, data: dict) -> Layout:
        try:
            return cls([CacheDir(str(d["path"]), int(d["weight"]), bool(d["healthy"]))
                        for d in data["dirs"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed layout from daemon: {exc}") from None
