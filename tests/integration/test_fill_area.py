"""Fill areas with a real blockcached: a block put by reference from a slot
of the shared memfd, the slot states, the seals, and bad requests."""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import struct
import time

import pytest

from blockcache_client.contract import blockfile, fillarea, layout
from blockcache_client.contract.errors import DaemonError
from blockcache_client.contract.protocol import ErrorCode
from blockcache_client.daemonclient import readerarea as reader_area
from blockcache_client.daemonclient.client import Client
from tests.support.blocks import VOLUME_KEY, make_block, make_key

SLOT = 64 << 10


def _open(c: Client, slots: int = 2, slot_bytes: int = SLOT):
    fd, slots, slot_bytes = c.open_area(slots, slot_bytes)
    return reader_area.ReaderArea(fd, slots, slot_bytes, c.connection_id)


def _put_from_slot(c: Client, area, key: str, blob: bytes):
    slot = area.take(len(blob))
    slot.view[:] = blob
    area.sent(slot)
    c.post("put", {"key": key, "area": slot.index, "size": len(blob)})
    [reply] = c.collect(wait=True)
    return slot, reply


def _state(area, slot) -> int:
    return area._map[slot.index]


def _wait_free(area, slot, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _state(area, slot) != fillarea.FREE:
        assert time.monotonic() < deadline, "the daemon never freed the slot"
        time.sleep(0.005)


def test_a_block_put_from_a_slot_is_written_and_the_slot_freed(daemon):
    c = daemon.client()
    area = _open(c)
    assert (area.slots, area.slot_bytes) == (2, SLOT)
    key = make_key()
    blob = make_block(key, 20000)
    slot, reply = _put_from_slot(c, area, key, blob)
    assert reply["ok"] and reply["accepted"] and reply["reason"] == "queued"
    _wait_free(area, slot)  # set by the daemon once the write is done
    daemon.wait_idle()
    path = os.path.join(daemon.cache_dirs[0], layout.block_relpath(key))
    with open(path, "rb") as f:
        assert f.read() == blob
    # a declined put (the block is there) frees its slot before the reply
    slot2, reply = _put_from_slot(c, area, key, blob)
    assert reply["ok"] and not reply["accepted"] and reply["reason"] == "exists"
    assert _state(area, slot2) == fillarea.FREE
    assert c.stats()["fill_areas"] == {"opened": 1, "puts": 2}


def test_the_area_cannot_shrink_or_grow(daemon):
    c = daemon.client()
    fd, slots, slot_bytes = c.open_area(1, 5000)  # rounded up to whole pages
    try:
        assert slot_bytes == 8192
        size = fillarea.area_bytes(slots, slot_bytes)
        assert os.fstat(fd).st_size == size
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 2 * size)
        m = mmap.mmap(fd, size)
        assert m[:slots] == bytes(slots)  # every slot FREE
        m.close()
    finally:
        os.close(fd)


def test_a_bad_block_in_a_slot_is_refused_and_the_slot_freed(daemon):
    c = daemon.client()
    area = _open(c)
    slot, reply = _put_from_slot(c, area, make_key(), os.urandom(5000))
    assert not reply["ok"] and reply["code"] == ErrorCode.INVALID_BLOCK
    assert _state(area, slot) == fillarea.FREE
    assert c.ping()["time"] > 0  # the daemon serves on


@pytest.mark.parametrize("args, says", [
    ({"area": 5, "size": 100}, "slot 5 does not exist"),
    ({"area": 0, "size": SLOT + 1}, "a slot holds"),
    ({"area": 0, "size": 0}, "a slot holds"),
    ({"area": -1, "size": 100}, "does not exist"),
])
def test_puts_naming_what_is_not_in_the_area_are_refused(daemon, args, says):
    c = daemon.client()
    _open(c)
    key = make_key()
    c.post("put", {"key": key, **args})
    [reply] = c.collect(wait=True)
    assert not reply["ok"] and reply["code"] == ErrorCode.BAD_REQUEST
    assert says in reply["message"]
    assert c.ping()["time"] > 0


def test_area_requests_the_daemon_refuses(daemon):
    c = daemon.client()
    # a put by reference on a connection without an area
    c.post("put", {"key": make_key(), "area": 0, "size": 100})
    [reply] = c.collect(wait=True)
    assert reply["code"] == ErrorCode.BAD_REQUEST and "area op" in reply["message"]
    for slots, slot_bytes, says in [(0, 4096, "1..4096 slots"), (8, 16 << 20, "at most"),
                                    (1, 0, "at least 1 byte")]:
        with pytest.raises(DaemonError, match=says):
            c.open_area(slots, slot_bytes)
    _open(c)
    with pytest.raises(DaemonError, match="one per connection"):
        c.open_area(1, 4096)
    # another connection gets its own; a block put from it lands too
    c2 = daemon.client()
    area2 = _open(c2)
    key = make_key(offset=4096)
    blob = make_block(key)
    _, reply = _put_from_slot(c2, area2, key, blob)
    assert reply["accepted"]
    daemon.wait_idle()
    [path] = c.lookup([key])
    with open(path, "rb") as f:
        assert blockfile.unseal(key, f.read(), VOLUME_KEY) is not None


def test_holes_in_a_slot_cost_the_daemon_no_memory(daemon):
    """A reader that never wrote most of a slot has the daemon copy holes:
    they must be read as zeros, not faulted in (pages charged to the daemon
    and kept while the connection lives)."""
    c = daemon.client()
    fd, slots, slot_bytes = c.open_area(1, 1 << 20)
    try:
        key = make_key()
        blob = make_block(key, 500_000)
        start = fillarea.slot_offset(0, slot_bytes)
        os.pwrite(fd, blob[:fillarea.PAGE], start)  # the header's page; the rest holes
        os.pwrite(fd, bytes([fillarea.SENT]), 0)
        c.post("put", {"key": key, "area": 0, "size": len(blob)})
        [reply] = c.collect(wait=True)
        assert reply["accepted"]
        daemon.wait_idle()
        path = os.path.join(daemon.cache_dirs[0], layout.block_relpath(key))
        with open(path, "rb") as f:
            written = f.read()
        assert written == blob[:fillarea.PAGE] + bytes(len(blob) - fillarea.PAGE)
        assert os.pread(fd, 1, 0) == bytes([fillarea.FREE])
        with pytest.raises(OSError):  # ENXIO: no data past the first page
            os.lseek(fd, start + fillarea.PAGE, os.SEEK_DATA)
    finally:
        os.close(fd)


def test_a_slot_rewritten_while_it_is_copied_never_reaches_a_block_path(daemon):
    """A reader that rewrites a slot after its put (a bug, or on purpose)
    races the daemon's copy. What lands at a block path has the header the
    daemon validated and the length declared (invariant 1), or nothing: the
    copy is checked in the tmp file before its rename (before: another
    block's header, or an invalid one, at a block path). Chunks rewritten
    under the same header can still land mixed: what a put by value of bad
    chunks leaves too, refused by readers' authentication."""
    c = daemon.client()
    size = 4 << 20  # a copy of a few ms: rewrites land before, during and after it
    area = _open(c, slots=1, slot_bytes=size + (64 << 10))
    rng = random.Random(5)
    outcomes = {"whole": 0, "chunks mixed": 0, "nothing": 0}
    for i in range(40):
        key = make_key(inode=100 + i)
        validated = make_block(key, size)
        other = make_block(make_key(inode=500 + i), size)  # same length, another header
        slot, reply = _put_from_slot(c, area, key, validated)
        assert reply["ok"] and reply["accepted"], reply
        time.sleep(rng.choice((0, 0.0005, 0.002, 0.005)))
        slot.view[:] = other  # while the daemon's worker may be copying
        _wait_free(area, slot)
        daemon.wait_idle()
        path = os.path.join(daemon.cache_dirs[0], layout.block_relpath(key))
        try:
            with open(path, "rb") as f:
                landed = f.read()
        except FileNotFoundError:
            outcomes["nothing"] += 1
            continue
        head = blockfile.HEADER_SIZE
        assert landed[:head] == validated[:head] and len(landed) == len(validated), \
            f"try {i}: a block path holds a header other than the one validated"
        outcomes["whole" if landed == validated else "chunks mixed"] += 1
    s = c.stats()
    assert outcomes["nothing"] >= 1 and s["slot_rewrites"] == outcomes["nothing"], (outcomes, s)
    assert s["write_errors"] == 0 and all(d["healthy"] for d in s["dirs"])


_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_HEAD = struct.Struct("=QQIIII")        # start, length, flags, mapped, count, reserved
_FIEMAP_EXTENT = struct.Struct("=QQQQQI12x")   # logical, physical, length, 2 reserved, flags
_FIEMAP_EXTENT_DELALLOC = 0x4


def _extent_flags(path: str, most: int = 64) -> list[int] | None:
    """The flags of the file's extents as the file system maps them now (no
    sync first); None where it cannot say (FIEMAP unsupported)."""
    buf = bytearray(_FIEMAP_HEAD.size + most * _FIEMAP_EXTENT.size)
    _FIEMAP_HEAD.pack_into(buf, 0, 0, 2**64 - 1, 0, 0, most, 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, _FS_IOC_FIEMAP, buf)
    except OSError:
        return None
    finally:
        os.close(fd)
    mapped = _FIEMAP_HEAD.unpack_from(buf)[3]
    return [_FIEMAP_EXTENT.unpack_from(buf, _FIEMAP_HEAD.size + i * _FIEMAP_EXTENT.size)[5]
            for i in range(mapped)]


def test_a_block_from_a_slot_lands_in_blocks_reserved_for_it(daemon):
    """The daemon reserves a slot's block file's blocks before the copy, so
    ext4 maps each page-cache folio to that extent instead of reserving
    delayed allocation folio by folio (DESIGN.md, "What a put costs"): just
    after the write its extents are allocated, none delayed."""
    c = daemon.client()
    area = _open(c, slots=1, slot_bytes=(4 << 20) + (64 << 10))
    key = make_key()
    blob = make_block(key, 4 << 20)
    slot, reply = _put_from_slot(c, area, key, blob)
    assert reply["accepted"], reply
    _wait_free(area, slot)
    daemon.wait_idle()
    path = os.path.join(daemon.cache_dirs[0], layout.block_relpath(key))
    flags = _extent_flags(path)
    if flags is None:
        pytest.skip("the test dir's file system does not map extents (FIEMAP)")
    assert flags and not any(f & _FIEMAP_EXTENT_DELALLOC for f in flags), \
        [hex(f) for f in flags]
    with open(path, "rb") as f:
        assert f.read() == blob
