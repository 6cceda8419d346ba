"""Random files on a local "remote" dir, for tests that read them back, and
their digests."""

from __future__ import annotations

import hashlib
import os
import random


def random_files(root, n: int, size: int, prefix: str = "f") -> dict[str, bytes]:
    """`n` files of `size` random bytes in `root`, named `{prefix}000.bin`
    on; returns {name: bytes}."""
    files = {}
    for i in range(n):
        name = f"{prefix}{i:03d}.bin"
        files[name] = os.urandom(size)
        (root / name).write_bytes(files[name])
    return files


def write_dataset(root: str, sizes: list[int], seed: int = 1) -> dict[str, bytes]:
    """Files of the given sizes under `root`; returns {relative path: bytes}."""
    rng = random.Random(seed)
    files = {}
    for i, size in enumerate(sizes):
        rel = f"d{i % 3}/f{i:03d}.bin"
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = rng.randbytes(size)
        with open(path, "wb") as f:
            f.write(data)
        files[rel] = data
    return files


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
