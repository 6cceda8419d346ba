"""Large files read whole: the bytes equal the source's for every read size and offset
pattern, cold and warm (where a read's chunks decrypt on several threads:
reader.decrypt), with a block evicted mid-read, and with the
source changed mid-read (ESTALE, never bytes of two versions)."""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockcache_client import Volume
from blockcache_client.contract import blockfile
from blockcache_client.contract.errors import IntegrityError
from blockcache_client.reader.decrypt import ParallelDecrypt
from tests.support.waiting import wait_for

BS = 1 << 20
SIZE = 5 * BS + 12345   # five whole blocks and a short one
# whole-file passes; smaller reads come at random offsets (Hypothesis) and
# in a short run across a block boundary
PATTERNS = [65536, 100_000, 256 << 10, BS, BS + 1, 3 * BS]

def _volume(source, key_file, daemon, **kw) -> Volume:
    vol = Volume("large", source.url, key_file, socket_path=daemon.socket_path, block_size=BS,
                 **kw, **source.options)
    wait_for(lambda: vol.stats()["daemon_connected"], what="the daemon link")
    return vol


def _read_patterns(vol, data: bytes) -> None:
    """Front to back in each size through read and readinto, then Volume.read
    at random offsets and sizes."""
    for size in PATTERNS:
        with vol.open("big.bin") as f:
            got = bytearray()
            while chunk := f.read(size):
                got += chunk
        assert got == data, size
        with vol.open("big.bin") as f:
            buf = bytearray(size)
            pos = 0
            while n := f.readinto(buf):
                assert buf[:n] == data[pos:pos + n], (size, pos)
                pos += n
        assert pos == len(data)
    with vol.open("big.bin") as f:
        f.seek(BS - 3 * 4096 - 1)
        for size in (1, 4096, 4096, 4096, 1, 4096):
            pos = f.tell()
            assert f.read(size) == data[pos:pos + size]

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(0, SIZE), st.integers(0, 2 * BS))
    def at(offset, size):
        assert vol.read("big.bin", offset, size) == data[offset:offset + size]
    at()


def test_every_pattern_cold_then_warm(local_source, key_file, daemon):
    data = random.Random(33).randbytes(SIZE)
    local_source.write("big.bin", data)
    with _volume(local_source, key_file, daemon, memory_cache_bytes=4 * BS) as cold:
        _read_patterns(cold, data)
        assert cold.wait_fills(20)
    with _volume(local_source, key_file, daemon, memory_cache_bytes=0) as warm:
        _read_patterns(warm, data)
        s = warm.stats()
        assert s["misses"] == 0 and s["hits"] > 0
        assert s["parallel_decrypt_reads"] > 0 and s["decrypt_threads"] >= 2


def test_block_evicted_mid_read(local_source, key_file, daemon):
    data = random.Random(34).randbytes(SIZE)
    local_source.write("big.bin", data)
    with _volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        assert vol.read("big.bin", 0, SIZE) == data
        assert vol.wait_fills(20)
        with vol.open("big.bin") as f:
            got = bytearray(f.read(2 * BS + 7))
            assert vol.evict("big.bin") > 0  # every block, under the reader's feet
            while chunk := f.read(BS):
                got += chunk
        assert got == data
        assert vol.stats()["misses"] > 0  # the rest came from the source again


def test_source_changed_mid_read_is_estale(local_source, key_file, daemon):
    old = random.Random(35).randbytes(SIZE)
    new = random.Random(36).randbytes(SIZE)  # same size: only the version differs
    local_source.write("big.bin", old)
    with _volume(local_source, key_file, daemon, memory_cache_bytes=2 * BS) as vol:
        f = vol.open("big.bin")
        got = bytearray(f.read(BS))
        local_source.write("big.bin", new)
        with pytest.raises(OSError) as e:
            while chunk := f.read(BS):
                got += chunk
        assert e.value.errno == errno.ESTALE
        assert got == old[:len(got)] and len(got) < SIZE
        f.close()
        assert vol.read("big.bin", 0, SIZE) == new  # a fresh stat sees the new version


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([4 * BS, 4 * BS - 12345, 300_000]), st.data())
def test_parallel_decrypt_equals_the_library(length, data):
    """Any range of a block, shared over threads, decrypts as BlockCipher does alone."""
    plain, blob = _sealed(length)
    offset = data.draw(st.integers(0, length))
    size = data.draw(st.integers(0, length - offset))
    cipher, body = _span(blob, length, offset, size)
    out = memoryview(bytearray(size))
    _PD.read_range_into(cipher, offset, body, out)
    assert out == plain[offset:offset + size]


def test_a_read_never_waits_for_a_pool_thread_that_has_not_started():
    """With the pool's one thread held elsewhere, the caller opens every unit
    itself and returns; the withdrawn job never runs later."""
    plain, blob = _sealed(4 * BS)
    pd = ParallelDecrypt(2)
    held = threading.Event()
    try:
        pd._workers().submit(held.wait, 30)  # the pool's only thread: busy
        cipher, body = _span(blob, 4 * BS, BS // 2, 2 * BS)
        out = memoryview(bytearray(2 * BS))
        done = threading.Thread(target=pd.read_range_into, args=(cipher, BS // 2, body, out))
        done.start()
        done.join(10)
        assert not done.is_alive() and out == plain[BS // 2:BS // 2 + 2 * BS]
        assert pd.stats()["parallel_decrypt_reads"] == 1
        out[:] = bytes(2 * BS)
        held.set()
        pd.close()  # the pool drains: a withdrawn job would write `out` again
        assert out == bytes(2 * BS)
    finally:
        held.set()
        pd.close()


def test_a_forged_chunk_zeroes_the_whole_read():
    plain, blob = _sealed(4 * BS)
    step = blockfile.DEFAULT_CHUNK + blockfile.TAG_SIZE
    blob[blockfile.HEADER_SIZE + 25 * step + 100] ^= 1  # chunk 25: a pool thread's slice
    cipher, body = _span(blob, 4 * BS, BS, BS)
    out = memoryview(bytearray(os.urandom(BS)))
    with pytest.raises(IntegrityError, match="chunk 25"):
        _PD.read_range_into(cipher, BS, body, out)
    assert out == bytes(BS)


_PD = ParallelDecrypt(4)
_VK = os.urandom(32)
_SEALED: dict[int, tuple[bytes, bytearray]] = {}


def _sealed(length: int) -> tuple[bytes, bytearray]:
    if length not in _SEALED:
        plain = os.urandom(length)
        _SEALED[length] = (plain, bytearray(blockfile.seal("k", plain, _VK)))
    plain, blob = _SEALED[length]
    return plain, bytearray(blob)


def _span(blob: bytearray, length: int, offset: int, size: int):
    cipher = blockfile.BlockCipher.from_head(bytes(blob[:blockfile.HEADER_SIZE]), "k", _VK,
                                             blockfile.key_id(_VK))
    first, end = blockfile.chunk_span(length, blockfile.DEFAULT_CHUNK, offset, size)
    step = blockfile.DEFAULT_CHUNK + blockfile.TAG_SIZE
    stop = min(end * step, length + end * blockfile.TAG_SIZE)
    return cipher, memoryview(blob)[blockfile.HEADER_SIZE + first * step:
                                    blockfile.HEADER_SIZE + stop]
