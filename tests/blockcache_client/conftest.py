"""Fixtures for the reader tests: key files, a moto S3 server, volume sources."""

from __future__ import annotations

import os
import uuid

import pytest

from devtools.s3server import S3Server


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 for the whole session; always stopped."""
    server = S3Server()
    try:
        server.start()
        yield server
    finally:
        server.stop()


class LocalSource:
    """A volume source in a local directory."""

    kind = "local"

    def __init__(self, root):
        self.root = str(root)
        os.makedirs(self.root, exist_ok=True)
        self.url = self.root
        self.options: dict = {}

    def write(self, rel: str, data: bytes) -> None:
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        old = os.stat(path).st_mtime_ns if os.path.exists(path) else 0
        with open(path, "wb") as f:
            f.write(data)
        # a rewrite must look new even within one mtime tick of the last write
        st = os.stat(path)
        if st.st_mtime_ns <= old:
            os.utime(path, ns=(st.st_atime_ns, old + 1_000_000))

    def remove(self, rel: str) -> None:
        os.unlink(os.path.join(self.root, rel))


class S3Source:
    """A volume source under a fresh prefix of the moto bucket."""

    kind = "s3"

    def __init__(self, server: S3Server):
        self.prefix = f"t-{uuid.uuid4().hex[:12]}"
        self.url = server.url(self.prefix)
        self.options = dict(server.storage_options)
        self.fs = server.filesystem()
        self.base = f"{server.bucket}/{self.prefix}"
        self.fs.pipe(f"{self.base}/.keep", b"")  # the prefix exists as a dir

    def write(self, rel: str, data: bytes) -> None:
        self.fs.pipe(f"{self.base}/{rel}", data)

    def remove(self, rel: str) -> None:
        self.fs.rm(f"{self.base}/{rel}")


@pytest.fixture(params=["local", "s3"])
def source(request, tmp_path):
    """A writable volume source: a local directory, or a prefix on moto S3."""
    if request.param == "local":
        return LocalSource(tmp_path / "src")
    return S3Source(request.getfixturevalue("s3_server"))


@pytest.fixture
def local_source(tmp_path):
    return LocalSource(tmp_path / "src")
