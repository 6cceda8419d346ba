"""Fixtures shared by every test package (real daemon, real S3 server, ...)."""

import pytest

from tests.support.daemon import DaemonProcess


@pytest.fixture
def daemon(tmp_path):
    """A started `blockcached` on one 1G cache dir under tmp_path; always stopped."""
    d = DaemonProcess(tmp_path)
    try:
        d.start()
        yield d
    finally:
        d.stop()
