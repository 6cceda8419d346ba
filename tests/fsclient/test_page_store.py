"""Random reads through the mount hand the rest of each decrypted chunk to the
kernel's page cache (`fsclient.pagestore`, `store_pages`, on by default): a
read of a neighbouring page then makes no read request. A store never puts an
older version's bytes in front of an open of a newer one. With
`store_pages = false` nothing is stored."""

from __future__ import annotations

import errno
import os
import time

import pytest

from tests.support.pagecache import random_fd, resident_map

from .conftest import BLOCK

pytestmark = pytest.mark.fuse

CHUNK = 64 << 10  # blocks of BLOCK bytes are sealed in 64 KiB chunks
PAGE = 4096


def _storing(tmp_path, *args: str) -> list[str]:
    """Mount arguments that turn the store on."""
    config = tmp_path / "store.toml"
    config.write_text("store_pages = true\n")
    return ["--config", str(config), *args]


def _reads(m) -> int:
    return m.stats()["fsclient"]["ops"].get("read", 0)


def _settled(m, before: dict, timeout: float = 10.0) -> dict:
    """The mount's counters once the store thread has written (or refused)
    something since `before`."""
    deadline = time.monotonic() + timeout
    while True:
        now = m.stats()["fsclient"]
        if (now["stored_pages"], now["stores_skipped"]) != (
                before["stored_pages"], before["stores_skipped"]):
            return now
        assert time.monotonic() < deadline, "the page store did nothing"
        time.sleep(0.01)


def test_a_random_read_puts_its_chunk_in_the_page_cache(tmp_path, tree, daemon, mounts):
    tail_bytes = os.urandom(BLOCK + 3 * PAGE + 100)  # its last chunk: 4 pages, the last partial
    (tree / "tail.bin").write_bytes(tail_bytes)
    m = mounts(f"file://{tree}", daemon.socket_path, args=_storing(tmp_path))
    path, want = m.cached("big.bin", daemon)
    assert want == (tree / "big.bin").read_bytes()
    fd = random_fd(path)
    try:
        base = 2 * BLOCK + 3 * CHUNK  # a chunk that is not its block's first
        before = m.stats()["fsclient"]
        assert os.pread(fd, PAGE, base + 5 * PAGE) == want[base + 5 * PAGE:base + 6 * PAGE]
        after = _settled(m, before)
        assert after["stored_pages"] - before["stored_pages"] == CHUNK // PAGE - 1
        first = base // PAGE
        assert resident_map(fd)[first:first + CHUNK // PAGE] == [True] * (CHUNK // PAGE)
        reads = _reads(m)
        for page in (0, 9, 15):  # the kernel answers them: no read request
            off = base + page * PAGE
            assert os.pread(fd, PAGE, off) == want[off:off + PAGE]
        assert _reads(m) == reads
    finally:
        os.close(fd)
    # a file's last chunk: stored up to the end of the file, never past it
    path, got = m.cached("tail.bin", daemon)
    assert got == tail_bytes
    fd = random_fd(path)
    try:
        before = m.stats()["fsclient"]
        assert os.pread(fd, PAGE, BLOCK) == tail_bytes[BLOCK:BLOCK + PAGE]
        after = _settled(m, before)
        assert after["stored_pages"] - before["stored_pages"] == 3
        assert os.fstat(fd).st_size == len(tail_bytes)
        reads = _reads(m)
        assert os.pread(fd, 4 * PAGE, BLOCK + PAGE) == tail_bytes[BLOCK + PAGE:]
        assert _reads(m) == reads
    finally:
        os.close(fd)


def test_no_store_of_an_old_version_after_a_new_one_is_opened(tmp_path, tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path, args=_storing(tmp_path, "--meta-ttl", "0"))
    src = tree / "big.bin"
    old = src.read_bytes()
    path = os.path.join(m.mountpoint, "big.bin")
    fd = random_fd(path)  # pinned to the old version
    try:
        # the old version's blocks into the cache (through this handle: with a
        # TTL of 0 every other open is a new version for the kernel)
        assert os.pread(fd, len(old), 0) == old
        daemon.wait_idle()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        # the store works: a read puts its chunk's other pages in the page cache
        before = m.stats()["fsclient"]
        assert os.pread(fd, PAGE, 0) == old[:PAGE]
        _settled(m, before)
        assert resident_map(fd)[:CHUNK // PAGE] == [True] * (CHUNK // PAGE)
        new = bytes(reversed(old))  # a new version, same size
        src.write_bytes(new)
        os.utime(src, ns=(time.time_ns() + 10**9,) * 2)
        fresh = random_fd(path)  # the new version: the kernel drops the old pages
        try:
            base = 5 * CHUNK
            # the old handle reads a page of another chunk: its read request
            # is answered ESTALE, not with the old version's bytes (see
            # test_stale_answers.py), and the rest of the chunk it decrypted
            # must not go to the page cache the new open reads from
            before = m.stats()["fsclient"]
            with pytest.raises(OSError) as err:
                os.pread(fd, PAGE, base)
            assert err.value.errno == errno.ESTALE
            after = _settled(m, before)
            for page in (0, 1, 8, 15):
                off = base + page * PAGE
                assert os.pread(fresh, PAGE, off) == new[off:off + PAGE]
            assert after["stored_pages"] == before["stored_pages"]
        finally:
            os.close(fresh)
    finally:
        os.close(fd)


def test_nothing_is_stored_when_turned_off(tmp_path, tree, daemon, mounts):
    config = tmp_path / "nostore.toml"
    config.write_text("store_pages = false\n")
    m = mounts(f"file://{tree}", daemon.socket_path, args=["--config", str(config)])
    path, _ = m.cached("big.bin", daemon)
    fd = random_fd(path)
    try:
        os.pread(fd, PAGE, 2 * BLOCK + 5 * PAGE)
        reads = _reads(m)
        os.pread(fd, PAGE, 2 * BLOCK + 9 * PAGE)  # a neighbour: asked for
        assert _reads(m) == reads + 1
        assert m.stats()["fsclient"]["stored_pages"] == 0
    finally:
        os.close(fd)
