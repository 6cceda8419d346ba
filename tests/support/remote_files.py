"""Random files on a local "remote" dir, for tests that read them back."""

from __future__ import annotations

import os


def random_files(root, n: int, size: int, prefix: str = "f") -> dict[str, bytes]:
    """`n` files of `size` random bytes in `root`, named `{prefix}000.bin`
    on; returns {name: bytes}."""
    files = {}
    for i in range(n):
        name = f"{prefix}{i:03d}.bin"
        files[name] = os.urandom(size)
        (root / name).write_bytes(files[name])
    return files
