"""Fixtures for fsclient tests: a sample source tree, a volume key, and real
mounts that are always unmounted (and their processes killed) at teardown."""

from __future__ import annotations

import os
import random

import pytest

from blockcache_client.volumekey import generate_key_file
from devtools.s3server import S3Server
from tests.support.fsclient_mounts import FsclientMount
from tests.support.skips import fuse_usable

BLOCK = 256 << 10  # small blocks, so modest files span several


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 for the module's tests; always stopped."""
    server = S3Server()
    try:
        yield server.start()
    finally:
        server.stop()


def pytest_collection_modifyitems(items):
    skip = pytest.mark.skip(reason="needs root and /dev/fuse")
    for item in items:
        if "fuse" in item.keywords and not fuse_usable():
            item.add_marker(skip)


def make_tree(root) -> None:
    """Nested dirs, empty/small/multi-block files, a symlink, odd names."""
    rng = random.Random(1234)
    os.makedirs(root, exist_ok=True)
    sizes = [0, 1, 4095, 100 << 10, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 12345]
    for d in range(3):
        for sub in range(2):
            path = os.path.join(root, f"dir{d}", f"sub{sub}")
            os.makedirs(path)
            for i, size in enumerate(sizes[(d + sub) % 3::2]):
                with open(os.path.join(path, f"file{i}.bin"), "wb") as f:
                    f.write(rng.randbytes(size))
    with open(os.path.join(root, "big.bin"), "wb") as f:
        f.write(rng.randbytes(5 * (1 << 20) + 777))
    with open(os.path.join(root, "with space.txt"), "w") as f:
        f.write("spaces\n")
    with open(os.path.join(root, "ünïcode.txt"), "w") as f:
        f.write("unicode\n")
    # a name that is not UTF-8: must survive end to end via surrogateescape
    with open(os.path.join(os.fsencode(root), b"odd-\xff\xfe.bin"), "wb") as f:
        f.write(b"odd bytes\n")
    os.symlink("dir0/sub0/file0.bin", os.path.join(root, "link"))
    os.makedirs(os.path.join(root, "empty"))


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "remote"
    make_tree(root)
    return root


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "volume.key"
    generate_key_file(str(path))
    return path


@pytest.fixture
def mounts(tmp_path, key_file):
    """Factory: mounts(source, socket, name="mnt", args=[...]) -> started mount.
    Every mount made is stopped (SIGTERM, kill, fusermount3 -uz) at teardown."""
    made: list[FsclientMount] = []

    def make(source, socket, name="mnt", args=(), key=None, start=True, volume="testvol"):
        m = FsclientMount(source, tmp_path / name, key or key_file, socket, volume=volume,
                          args=["--block-size", str(BLOCK), *args],
                          log_path=str(tmp_path / f"{name}.log"))
        made.append(m)
        return m.start() if start else m

    try:
        yield make
    finally:
        for m in reversed(made):
            m.stop()
