"""Sequential reads through the handlers decrypt straight into reused reply
buffers (`handles.OpenFiles.replies`): the bytes equal the source's for every
read size and start, a reply still referred to (not yet written to the
kernel) is never written over, and a read that fails returns no bytes of an
earlier one. A real daemon holds the blocks; the reader keeps none in memory."""

from __future__ import annotations

import errno
import os

import pytest

from blockcache_client import Volume
from fsclient.config import build_config
from fsclient.fs import BlockcacheFS
from fsclient.handles import REPLY_BYTES
from fsclient.inodes import ROOT_INODE
from fsclient.session import FuseError
from tests.support.volumes import cached_block_path, damage_block
from tests.support.waiting import wait_for

BS = 1 << 20
SIZE = 5 * BS + 12345


@pytest.fixture
def warm(tmp_path, key_file, daemon):
    """An fs over a file whose blocks are all on the cache disk, and its bytes."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(SIZE)
    (src / "big").write_bytes(data)
    kw = dict(socket_path=daemon.socket_path, block_size=BS)
    with Volume("v", str(src), str(key_file), **kw) as filler:
        wait_for(lambda: filler.stats()["daemon_connected"], what="the daemon link")
        assert filler.read("big", 0, SIZE) == data
        assert filler.wait_fills(20)
    daemon.wait_idle()
    vol = Volume("v", str(src), str(key_file), memory_cache_bytes=0, **kw)
    wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon link")
    cfg = build_config(volume="v", source=str(src), mountpoint=str(tmp_path / "m"),
                       key_file=str(key_file), socket=daemon.socket_path, block_size=str(BS),
                       readahead_blocks=0)
    f = BlockcacheFS(vol, cfg)
    try:
        yield f, vol, src, data
    finally:
        f.close()
        vol.close()


def _open(f):
    ino = f.lookup(ROOT_INODE, b"big").st_ino
    return f.open(ino, os.O_RDONLY)[0]


@pytest.mark.parametrize("size", [64 << 10, 132 << 10, REPLY_BYTES, REPLY_BYTES + 4096])
@pytest.mark.parametrize("start", [0, 3 * 4096, BS - (64 << 10) + 100])
def test_every_size_and_start_reads_the_source_bytes_from_the_disk_cache(warm, size, start):
    f, vol, _, data = warm
    fh = _open(f)
    got = bytearray()
    off = start
    while piece := f.read(fh, off, size):  # the first read at 0, or two small ones first
        got += piece  # (copied before the next read, as the session writes it)
        off += len(piece)
    f.release(fh)
    assert got == data[start:]
    assert vol.stats()["misses"] == 0  # every byte decrypted from the cache disk
    if size <= REPLY_BYTES and start == 0:
        # two buffers (`piece` holds the last reply while the next is read), reused
        replies = f.open_files.replies
        assert replies.kept_bytes == 2 * REPLY_BYTES and replies.reused > 0


def test_a_reply_still_referred_to_is_never_written_over(warm):
    f, _, _, data = warm
    fh = _open(f)
    head = 256 << 10
    assert f.read(fh, 0, head) == data[:head]  # (a handle's first read starts the run)
    at = [head + b * BS for b in range(5)]
    held = [f.read(fh, a, BS) for a in at[:3]]  # none written to the kernel yet
    assert [bytes(h) for h in held] == [data[a:a + BS] for a in at[:3]]
    assert f.open_files.replies.kept_bytes == 3 * REPLY_BYTES
    del held
    assert f.read(fh, at[3], BS) == data[at[3]:at[3] + BS]
    tail = f.read(fh, at[4], BS)  # a short read at the end, into a buffer full before
    assert tail == data[at[4]:] and len(tail) == SIZE - at[4] < BS
    assert f.open_files.replies.reused == 2 and f.open_files.replies.kept_bytes == 3 * BS
    f.release(fh)


def test_a_failed_read_returns_no_bytes_of_an_earlier_one(warm, daemon):
    f, vol, src, data = warm
    fh = _open(f)
    assert f.read(fh, 0, BS) == data[:BS]  # (a handle's first read starts the run)
    assert bytes(f.read(fh, BS, BS)) == data[BS:2 * BS]  # a reply buffer: block 1's bytes
    # block 2: a bad chunk on the cache disk, and the source gone (the refetch fails)
    _, path = cached_block_path(vol, daemon, "big", 2 * BS)
    damage_block(path, "body")
    os.unlink(src / "big")
    with pytest.raises(FuseError) as exc:
        f.read(fh, 2 * BS, BS)  # into that same buffer, reused
    assert exc.value.errno in (errno.ESTALE, errno.EIO, errno.ENOENT)
    assert f.open_files.replies.reused == 1 and f.open_files.replies.kept_bytes == BS
    assert bytes(f.read(fh, 3 * BS, BS)) == data[3 * BS:4 * BS]  # block 3 still served
    f.release(fh)
