"""Versioned block reads: a multi-block file's blocks are all of the version
pinned at open (Backend.read_version), proven inside the read on S3 (If-Match)
and local files (fstat around pread), by a stat after it elsewhere."""

from __future__ import annotations

import errno
import random

import pytest

from tests.support.volumes import BS, settle, volume, wait_connected

NBLOCKS = 4


def overwrite_between_blocks(source, key_file, daemon, **kw):
    """Open a 4-block file, read block 0, overwrite it with the same size, read
    block 2 with the pinned version: (error, volume stats, pinned info, volume)."""
    old = random.Random(10).randbytes(NBLOCKS * BS)
    new = random.Random(11).randbytes(NBLOCKS * BS)  # same size: only the version differs
    source.write("f.bin", old)
    vol = volume(source, key_file, daemon, **kw)
    try:
        wait_connected(vol)
        pinned = vol.stat("f.bin")
        assert vol.read("f.bin", 0, 10, info=pinned) == old[:10]
        source.write("f.bin", new)
        with pytest.raises(OSError) as e:
            vol.read("f.bin", 2 * BS, 10, info=pinned)
        settle(vol, daemon)
        return e.value, old, new, pinned, vol
    except BaseException:
        vol.close()
        raise


def test_overwritten_file_is_estale_and_never_cached_under_old_key(source, key_file, daemon):
    check_overwrite(source, key_file, daemon, "native")


def test_overwrite_through_the_stat_fallback_is_estale(local_source, key_file, daemon):
    via_latency(local_source)
    check_overwrite(local_source, key_file, daemon, "fallback")


def via_latency(source) -> None:
    """Read a local dir through latency:: (no delay): a backend with neither
    conditional reads nor a descriptor, so read_version stats after reading."""
    source.url = f"latency::file://{source.root}"
    source.options = {"latency": {"delay": 0}}


def check_overwrite(source, key_file, daemon, kind: str) -> None:
    err, old, new, pinned, vol = overwrite_between_blocks(source, key_file, daemon)
    with vol:
        assert vol.backend.native_versioned_reads == (kind == "native")
        assert err.errno == errno.ESTALE
        assert "f.bin" in str(err)
        # only block 0 (read before the overwrite) is cached under the old
        # version's keys: no block of the new bytes went in under them
        assert [cached for _, _, cached in vol.block_map("f.bin", info=pinned)] == \
            [True, False, False, False]
        with pytest.raises(OSError) as again:  # memory LRU holds nothing for it either
            vol.read("f.bin", 2 * BS, 10, info=pinned)
        assert again.value.errno == errno.ESTALE
        assert vol.read("f.bin", 0, 10, info=pinned) == old[:10]
        # the stale stat was dropped: a plain read sees the new version
        assert vol.read("f.bin", 2 * BS, 10) == new[2 * BS:2 * BS + 10]
        checks = vol.stats()["version_checks"]
        assert (checks > 0) == (kind == "fallback")


def cold_read_requests(source, key_file):
    """Backend calls (by kind) and Volume.stats() of one cold read of a 4-block file."""
    data = random.Random(12).randbytes(NBLOCKS * BS - 5)
    source.write("big.bin", data)
    calls: list[str] = []
    with volume(source, key_file) as vol:  # no daemon: every block comes from the backend
        vol.backend.observe = lambda what, seconds, exc: calls.append(what)
        assert vol.read("big.bin", 0, len(data)) == data
        return calls, vol.stats()


def test_cold_multiblock_read_is_one_versioned_request(source, key_file):
    calls, stats = cold_read_requests(source, key_file)
    assert sorted(calls) == ["read", "stat"]
    assert stats["backend_requests"] == 1
    assert stats["version_checks"] == 0


def test_generic_backend_counts_its_version_checks(local_source, key_file):
    via_latency(local_source)
    calls, stats = cold_read_requests(local_source, key_file)
    # one ranged read of all the blocks, one stat to check its version
    assert sorted(calls) == ["read", "stat", "stat"]
    assert stats["backend_requests"] == 2
    assert stats["version_checks"] == 1


def test_single_block_file_is_one_plain_read(source, key_file):
    source.write("one.bin", b"z" * 100)
    calls: list[str] = []
    with volume(source, key_file) as vol:
        vol.backend.observe = lambda what, seconds, exc: calls.append(what)
        assert vol.read("one.bin", 0, 100) == b"z" * 100
        assert sorted(calls) == ["read", "stat"]
        assert vol.stats()["backend_requests"] == 1

