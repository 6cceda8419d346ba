"""Once an open of a file's new version has been answered, the kernel's page
cache of the inode is the new version's: a read request of a handle opened
on the old version gets ESTALE, so its old bytes never land where the new
open reads (`fsclient/handles.py`, `answering`). Reopening the same version
(a metadata TTL of 0) fails nothing."""

from __future__ import annotations

import errno
import os
import time

import pytest

from .conftest import BLOCK

pytestmark = pytest.mark.fuse

PAGE = 4096


def _rewrite(src, data: bytes) -> None:
    """A new version of `src`: new bytes, same size, a later mtime."""
    src.write_bytes(data)
    os.utime(src, ns=(time.time_ns() + 10**9,) * 2)


def test_an_old_handles_read_never_reaches_a_new_open(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path, args=["--meta-ttl", "0"])
    src = tree / "big.bin"
    old = src.read_bytes()
    path = os.path.join(m.mountpoint, "big.bin")
    with open(path, "rb", buffering=0) as a:
        assert a.read(BLOCK) == old[:BLOCK]  # (the kernel reads ahead into its page cache)
        with open(path, "rb", buffering=0) as same:  # the same version again: nothing fails
            assert same.read(BLOCK) == old[:BLOCK]
        assert a.read(BLOCK) == old[BLOCK:2 * BLOCK]
        new = bytes(reversed(old))
        _rewrite(src, new)
        with open(path, "rb", buffering=0) as b:  # the kernel drops the old pages
            far = len(old) - 3 * PAGE  # a page no read has brought in since the drop
            a.seek(far)
            try:
                got = a.read(PAGE)  # answered with the old bytes, they would stay cached
            except OSError as exc:
                got = exc.errno
            b.seek(far)
            assert b.read(PAGE) == new[far:far + PAGE]
            b.seek(0)
            assert b.read() == new
            assert got == errno.ESTALE
    assert m.stats()["fsclient"]["stale_answers"] >= 1
