"""Volume.readinto_nowait: serves a hit only from the kernel's caches, never
waits on the disk or the backend, and leaves every judgement (misses, bad
blocks) to the blocking read."""

from __future__ import annotations

import random

import pytest

from blockcache_client.common import nowait
from tests.support.pagecache import UNDEFERRED, drop_pages, nowait_read_defers
from tests.support.volumes import BS, cached_block_path, damage_block, fill, volume

pytestmark = pytest.mark.skipif(not nowait.SUPPORTED, reason="needs openat2 and RWF_NOWAIT")


def _counts(vol) -> tuple:
    s = vol.stats()
    return s["hits"], s["misses"], s["integrity_failures"], s["backend_requests"]


def test_cached_block_in_page_cache_is_served_without_backend(local_source, key_file, daemon):
    data = random.Random(1).randbytes(BS - 100)
    local_source.write("s.bin", data)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        fill(vol, daemon, "s.bin", data)
        _, path = cached_block_path(vol, daemon, "s.bin")
        with open(path, "rb") as f:
            f.read()  # its pages are in memory now
        info = vol.stat("s.bin")
        hits, misses, bad, requests = _counts(vol)
        buf = bytearray(len(data))
        assert vol.readinto_nowait("s.bin", 0, buf, info=info) == len(data)
        assert bytes(buf) == data
        assert _counts(vol) == (hits + 1, misses, bad, requests)
        # a range inside the block, and one past its end
        part = bytearray(1000)
        assert vol.readinto_nowait("s.bin", 500, part, info=info) == 1000
        assert bytes(part) == data[500:1500]
        assert vol.readinto_nowait("s.bin", len(data), bytearray(10), info=info) == 0


def test_uncached_block_defers_to_the_blocking_read(local_source, key_file, daemon):
    data = random.Random(2).randbytes(BS - 100)
    local_source.write("u.bin", data)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        info = vol.stat("u.bin")
        before = _counts(vol)
        # not cached at all: None, and nothing fetched or counted
        assert vol.readinto_nowait("u.bin", 0, bytearray(len(data)), info=info) is None
        assert _counts(vol) == before


def test_pages_on_disk_defer_to_the_blocking_read(local_source, key_file, daemon):
    data = random.Random(2).randbytes(BS - 100)
    local_source.write("u.bin", data)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        info = vol.stat("u.bin")
        fill(vol, daemon, "u.bin", data)
        _, path = cached_block_path(vol, daemon, "u.bin")
        # cached, but its pages are not in memory: reading them would wait on the
        # disk. (The kernel starts reading them and answers EAGAIN, unless that
        # read has completed by then, as a fast disk's may, or another process
        # read them in between on a busy machine: so tries until one defers.)
        before = _counts(vol)
        buf = bytearray(len(data))
        answers = []
        for _ in range(50):
            drop_pages(path)
            answers.append(vol.readinto_nowait("u.bin", 0, buf, info=info))
            if answers[-1] is None:
                break
        if None not in answers and not nowait_read_defers(path):
            pytest.skip(UNDEFERRED)  # (a plain RWF_NOWAIT read never defers here either)
        assert None in answers, answers
        assert _counts(vol)[1:] == before[1:]  # nothing missed, judged or fetched
        # the blocking read serves it (and brings its pages in); then nowait can
        assert vol.readinto("u.bin", 0, buf, info=info) == len(data) and bytes(buf) == data
        buf[:] = bytes(len(buf))
        assert vol.readinto_nowait("u.bin", 0, buf, info=info) == len(data)
        assert bytes(buf) == data


def test_range_over_two_blocks_is_not_served(local_source, key_file, daemon):
    data = random.Random(3).randbytes(2 * BS)
    local_source.write("m.bin", data)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        fill(vol, daemon, "m.bin", data)
        info = vol.stat("m.bin")
        assert vol.readinto_nowait("m.bin", BS - 10, bytearray(20), info=info) is None


@pytest.mark.parametrize("where", ["body", "truncate"])
def test_bad_block_is_left_to_the_blocking_read(local_source, key_file, daemon, where):
    data = random.Random(4).randbytes(BS - 100)
    local_source.write("c.bin", data)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        fill(vol, daemon, "c.bin", data)
        _, path = cached_block_path(vol, daemon, "c.bin")
        damage_block(path, where)
        with open(path, "rb") as f:
            f.read()
        info = vol.stat("c.bin")
        before = _counts(vol)
        buf = bytearray(len(data))
        assert vol.readinto_nowait("c.bin", 0, buf, info=info) is None
        assert bytes(buf) == bytes(len(buf))  # no unauthenticated bytes left in it either
        assert _counts(vol) == before  # not judged, not evicted here
        assert vol.readinto("c.bin", 0, buf, info=info) == len(data) and bytes(buf) == data
        assert vol.stats()["integrity_failures"] == before[2] + 1  # judged once, there
