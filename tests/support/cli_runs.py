"""The real CLIs (`python -m MODULE ...`) run as a user runs them, over a
sample volume: its name, block size and source tree, and the arguments of
`fsclient warmup` for it."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from tests.support.fsclient_mounts import REPO, env

BLOCK = 256 << 10  # small blocks, so modest files span several
VOLUME = "opsvol"


def make_tree(root: Path, seed: int = 7) -> dict[str, int]:
    """Files of assorted sizes (empty, sub-block, exact, multi-block) in nested
    dirs; returns {volume path: size}."""
    rng = random.Random(seed)
    sizes = [0, 1, 5000, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 777]
    out = {}
    for d in range(3):
        for i, size in enumerate(sizes):
            rel = f"dir{d}/sub/f{i}.bin" if i % 2 else f"dir{d}/f{i}.bin"
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(rng.randbytes(size))
            out[rel] = size
    os.symlink("dir0/f0.bin", root / "link")
    return out


def blocks_of(size: int) -> int:
    return -(-size // BLOCK)


def run_cli(module: str, *args: str, timeout: float = 90.0, **kw) -> subprocess.CompletedProcess:
    """Run `python -m module args` to completion (stdin closed, not a TTY)."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=env(), cwd=REPO, stdin=subprocess.DEVNULL, **kw)


def warmup_args(source, key_file, daemon, *extra: str) -> list[str]:
    """`fsclient warmup SOURCE --volume ... --key-file ... --socket ...` + extra."""
    return ["warmup", str(source), "--volume", VOLUME, "--key-file", str(key_file),
            "--socket", daemon.socket_path, "--block-size", str(BLOCK), *extra]
