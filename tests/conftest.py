"""Fixtures shared by every test package (real daemon, real S3 server, ...)."""

import os
import shutil
import tempfile

import pytest

from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess


def pytest_make_parametrize_id(config, val, argname):
    """Test ids the same in every process that collects the suite (each
    pytest-xdist worker does, and they must agree): bytes that are not text,
    such as random ones, are named by their length."""
    if isinstance(val, bytes) and not val.isascii():
        return f"{len(val)}-binary-bytes"
    return None


@pytest.fixture
def daemon(tmp_path):
    """A started `blockcached` on one 1G cache dir under tmp_path; always stopped."""
    d = DaemonProcess(tmp_path)
    try:
        d.start()
        yield d
    finally:
        d.stop()


@pytest.fixture
def key_file(tmp_path):
    """A fresh volume key file under tmp_path."""
    path = tmp_path / "volume.key"
    generate_key_file(str(path))
    return str(path)


@pytest.fixture
def shared_dir():
    """A 0755 temp dir outside pytest's 0700 tree, so uid nobody can reach it
    (for sockets that a dropped-privilege child must connect to)."""
    d = tempfile.mkdtemp(prefix="bc-shared-")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
