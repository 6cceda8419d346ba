"""`Volume.open_handle`: the open handle the FUSE client reads through, with
the caller's `blocking` context entered only for what needs a wait."""

from __future__ import annotations

import contextlib
import random

from tests.support.chunkvolumes import BS, CHUNK, filled, volume
from tests.support.waiting import wait_for


class Waits:
    """A `blocking` that counts how often a read entered it."""

    def __init__(self) -> None:
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self):
        self.entered += 1
        yield


def test_only_a_read_that_needs_a_wait_enters_blocking(local_source, key_file, daemon):
    data = random.Random(43).randbytes(2 * BS)
    filled(local_source, key_file, daemon, "warm.bin", data)  # on the cache disk
    local_source.write("cold.bin", data)  # in no cache
    local_source.write("half.bin", data)  # its first block cached, not its second
    with volume(local_source, key_file, daemon) as filler:
        # (a small read brings its block only: one at offset 0 would bring a window)
        assert filler.read("half.bin", 100, 4096) == data[100:4196]
        assert filler.wait_fills(10)
    daemon.wait_idle()
    with volume(local_source, key_file, daemon) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon")
        waits = Waits()
        warm = vol.open_handle("warm.bin")
        off = BS + 3 * CHUNK + 5 * 4096
        assert warm.note(off, 4096) is False  # a random read
        lo, got = warm.read_around(off, 4096, waits)
        assert (lo, bytes(got)) == (BS + 3 * CHUNK, data[lo:lo + CHUNK])  # its whole chunk
        assert waits.entered == 0 and vol.stats()["misses"] == 0
        cold = vol.open_handle("cold.bin")
        buf = bytearray(4096)
        assert cold.read(off, 4096, memoryview(buf), waits) == 4096
        assert buf == data[off:off + 4096] and waits.entered == 1  # the miss waited
        # a read across a cached block and one that is not: one wait, for the second
        cold.close()
        warm.close()
        half = vol.open_handle("half.bin")
        buf = bytearray(2 * CHUNK)
        assert half.read(BS - CHUNK, 2 * CHUNK, memoryview(buf), waits) == 2 * CHUNK
        assert buf == data[BS - CHUNK:BS + CHUNK] and waits.entered == 2
        half.close()


def test_a_closed_volume_refuses_a_handles_read(local_source, key_file, daemon):
    local_source.write("f.bin", b"x" * 100)
    vol = volume(local_source, key_file, daemon)
    h = vol.open_handle("f.bin")
    assert h.read(0, 10) == b"x" * 10
    vol.close()
    try:
        h.read(0, 10)
    except ValueError as exc:
        assert "closed" in str(exc)
    else:
        raise AssertionError("a closed volume's handle read")
    h.close()
