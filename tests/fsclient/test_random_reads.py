"""Random reads through the mount: the chunk cache keeps the whole chunk a
small read decrypted, and small reads that happen to fall near each other
start no sequential run (which would read whole blocks and fetch ahead)."""

from __future__ import annotations

import os

import pytest

from tests.support.waiting import wait_for

from .conftest import BLOCK

pytestmark = pytest.mark.fuse

CHUNK = 64 << 10  # blocks of BLOCK bytes are sealed in 64 KiB chunks


def test_small_random_reads_share_their_chunk_and_start_no_run(tree, daemon, mounts):
    m = mounts(f"file://{tree}", daemon.socket_path)
    path, want = m.cached("big.bin", daemon)
    assert want == (tree / "big.bin").read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        before = m.stats()
        base = 2 * BLOCK + 3 * CHUNK  # a chunk that is not its block's first
        for page in (5, 9, 2):  # three pages of it, forward, forward, back
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read reaches fsclient
            off = base + page * 4096
            assert os.pread(fd, 4096, off) == want[off:off + 4096]
        after = m.stats()
    finally:
        os.close(fd)
    # the first read decrypted the chunk and kept it whole: the others found it
    assert after["chunk_hits"] - before["chunk_hits"] >= 2
    assert after["fsclient"]["prefetches"] == before["fsclient"]["prefetches"]


def test_a_warm_4k_read_decrypts_the_one_chunk_it_answers(tree, daemon, mounts):
    """A read of a cached block (not in the server's memory) is served without
    a wait and decrypts its chunk once: no probe of the block's first chunk."""
    first = mounts(f"file://{tree}", daemon.socket_path, name="filler")
    first.cached("big.bin", daemon)  # on the cache disk, by another server
    first.stop()
    m = mounts(f"file://{tree}", daemon.socket_path)
    wait_for(lambda: m.stats()["daemon_connected"], what="the mount to reach the daemon")
    want = (tree / "big.bin").read_bytes()
    fd = os.open(os.path.join(m.mountpoint, "big.bin"), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # 4 KiB asked, not a readahead
        before = m.stats()
        off = 2 * BLOCK + 3 * CHUNK + 5 * 4096  # the handle's first read, not in chunk 0
        assert os.pread(fd, 4096, off) == want[off:off + 4096]
        after = m.stats()
    finally:
        os.close(fd)
    assert after["misses"] == before["misses"] and after["hits"] > before["hits"]
    assert after["chunks_decrypted"] - before["chunks_decrypted"] == 1
