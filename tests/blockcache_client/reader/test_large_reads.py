"""Large files read whole: the bytes equal the source's for every read size and offset
pattern, cold and warm (where a read's chunks decrypt on several threads:
reader.hits.decrypt), with a block evicted mid-read, and with the
source changed mid-read (ESTALE, never bytes of two versions)."""

from __future__ import annotations

import errno
import os
import random
import tempfile
import threading
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockcache_client import Volume
from blockcache_client.contract import blockfile
from blockcache_client.contract.errors import FormatError, IntegrityError
from blockcache_client.reader.hits.decrypt import ParallelDecrypt
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


def test_a_read_of_many_blocks_is_stored_once(local_source, key_file, daemon):
    """`read` of many blocks (a whole checkpoint for safetensors) stores them
    straight into the bytes it returns: the file's size in memory at the
    peak, not a bytes object per block and then their join (twice that)."""
    size = 8 * BS + 777
    data = random.Random(8).randbytes(size)
    local_source.write("whole.bin", data)
    with _volume(local_source, key_file, daemon, memory_cache_bytes=4 * BS) as cold:
        assert cold.read("whole.bin", 0, size) == data
        assert cold.wait_fills(20)
    with _volume(local_source, key_file, daemon, memory_cache_bytes=0) as warm:
        assert warm.read("whole.bin", 3, 2 * BS) == data[3:3 + 2 * BS]  # buffers made
        for read in (lambda: warm.read("whole.bin", 0, size + 10),
                     lambda: warm.open("whole.bin").read(),
                     lambda: warm.read("whole.bin", BS - 1, 3 * BS + 2)):
            tracemalloc.start()
            try:
                got = read()
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert type(got) is bytes and got == data[:len(got)] or \
                got == data[BS - 1:BS - 1 + 3 * BS + 2]
            assert peak < 1.3 * len(got), (peak, len(got))
        assert warm.stats()["misses"] == 0


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
        assert s["decrypt_buffer_bytes"] > 0


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
def test_parallel_reads_equal_the_library(length, data):
    """Any range of a block file, read and opened unit by unit over threads,
    equals what BlockCipher gives for it alone."""
    plain, fd, cipher = _sealed(length)
    offset = data.draw(st.integers(0, length - 1))
    size = data.draw(st.integers(1, length - offset))
    out = memoryview(bytearray(size))
    _PD.read_file_into(cipher, fd, offset, out)
    assert out == plain[offset:offset + size]


class _Watched:
    """A block's cipher that notes, for each unit opened, whether the read
    it belongs to had already returned (it must never have)."""

    def __init__(self, cipher):
        self.cipher = cipher
        self.chunk_size, self.plaintext_len = cipher.chunk_size, cipher.plaintext_len
        self.returned = False
        self.late = 0
        self.threads: set[str] = set()

    def open_into(self, *args):
        self.threads.add(threading.current_thread().name)
        time.sleep(random.random() * 0.0005)  # vary who takes which unit
        self.cipher.open_into(*args)
        if self.returned:
            self.late += 1

    def read_range_into(self, *args):
        self.cipher.read_range_into(*args)


def test_no_unit_is_opened_after_its_read_returned():
    """Helpers woken for a read but not started are taken back: whatever the
    timing, every unit is done when the read returns, and helpers share them."""
    plain, fd, cipher = _sealed(4 * BS)
    pd = ParallelDecrypt(3)
    helpers = set()
    try:
        for i in range(150):
            w = _Watched(cipher)
            offset = random.Random(i).randrange(0, BS)
            out = memoryview(bytearray(2 * BS))
            pd.read_file_into(w, fd, offset, out)
            w.returned = True
            assert out == plain[offset:offset + 2 * BS]
            helpers |= {t for t in w.threads if t.startswith("blockcache-decrypt")}
            time.sleep(0.001)  # a helper taken back may wake now: it must find nothing
            assert w.late == 0
        assert helpers  # the units were shared
        assert pd.stats()["parallel_decrypt_reads"] > 0
    finally:
        pd.close()


def test_a_helper_keeps_no_view_of_a_read_it_helped():
    """Once a read returns, no sleeping helper refers to its destination: a
    bytearray read into can be resized (it cannot while a view is exported)."""
    plain, fd, cipher = _sealed(4 * BS)
    pd = ParallelDecrypt(3)
    try:
        for i in range(50):
            dest = bytearray(3 * BS)
            pd.read_file_into(cipher, fd, i * 100, memoryview(dest))
            dest.extend(b"x")  # BufferError if a view of it were still held
            assert dest[:-1] == plain[i * 100:i * 100 + 3 * BS]
        assert pd.stats()["parallel_decrypt_reads"] > 0
    finally:
        pd.close()


def test_a_read_never_waits_for_a_busy_helper():
    """With the only helper stuck in another read's unit, a read opens every
    unit on its own thread and returns."""
    plain, fd, cipher = _sealed(4 * BS)
    pd = ParallelDecrypt(2)
    stuck, release = threading.Event(), threading.Event()

    class Stuck(_Watched):
        def open_into(self, *args):
            if threading.current_thread().name.startswith("blockcache-decrypt"):
                stuck.set()
                release.wait(30)
            self.cipher.open_into(*args)

    def first_reads():  # until the helper takes one of their units and sticks there
        while not stuck.is_set() and not release.is_set():
            pd.read_file_into(Stuck(cipher), fd, 0, memoryview(bytearray(2 * BS)))
    first = threading.Thread(target=first_reads)
    first.start()
    try:
        assert stuck.wait(10)
        out = memoryview(bytearray(2 * BS))
        done = threading.Thread(target=pd.read_file_into, args=(cipher, fd, BS // 2, out))
        done.start()
        done.join(10)
        assert not done.is_alive() and out == plain[BS // 2:BS // 2 + 2 * BS]
    finally:
        release.set()
        first.join(10)
        pd.close()


def test_close_during_a_read_lets_it_finish():
    """Closing the helpers while one is in a read's unit: the unit ends, the
    read returns its bytes, the helper exits."""
    plain, fd, cipher = _sealed(4 * BS)
    pd = ParallelDecrypt(2)
    stuck, release = threading.Event(), threading.Event()

    helper = []

    class Stuck(_Watched):
        def open_into(self, *args):
            if threading.current_thread().name.startswith("blockcache-decrypt"):
                helper.append(threading.current_thread())
                stuck.set()
                release.wait(30)
            self.cipher.open_into(*args)
    outs = []

    def reads():  # until the helper takes one of their units and sticks there
        while not stuck.is_set():
            out = memoryview(bytearray(2 * BS))
            pd.read_file_into(Stuck(cipher), fd, 0, out)
            outs.append(out)
    reader = threading.Thread(target=reads)
    reader.start()
    try:
        assert stuck.wait(10)
        pd.close()
        release.set()
        reader.join(10)
        assert not reader.is_alive()
        assert all(out == plain[:2 * BS] for out in outs) and outs
        helper[0].join(10)
        assert not helper[0].is_alive()
    finally:
        release.set()
        reader.join(10)


def test_a_forged_chunk_zeroes_the_whole_read():
    plain, fd, cipher = _sealed(4 * BS)
    step = blockfile.DEFAULT_CHUNK + blockfile.TAG_SIZE
    pos = blockfile.HEADER_SIZE + 25 * step + 100  # chunk 25: a helper's unit, maybe
    byte = os.pread(fd, 1, pos)
    os.pwrite(fd, bytes([byte[0] ^ 1]), pos)
    try:
        out = memoryview(bytearray(os.urandom(BS)))
        with pytest.raises(IntegrityError, match="chunk 25"):
            _PD.read_file_into(cipher, fd, BS, out)
        assert out == bytes(BS)
    finally:
        os.pwrite(fd, byte, pos)


def test_a_short_block_file_zeroes_the_whole_read(tmp_path):
    plain, fd, cipher = _sealed(4 * BS)
    path = tmp_path / "short"
    path.write_bytes(os.pread(fd, blockfile.HEADER_SIZE + 3 * BS, 0))
    short = os.open(path, os.O_RDONLY)
    try:
        out = memoryview(bytearray(os.urandom(BS)))
        with pytest.raises(FormatError, match="shorter"):
            _PD.read_file_into(cipher, short, 2 * BS + 4096, out)
        assert out == bytes(BS)
    finally:
        os.close(short)


_PD = ParallelDecrypt(4)
_VK = os.urandom(32)
_SEALED: dict[int, tuple[bytes, int, blockfile.BlockCipher]] = {}


def _sealed(length: int) -> tuple[bytes, int, blockfile.BlockCipher]:
    """Plaintext, an open fd of its block file (in a private temp file), its cipher."""
    if length not in _SEALED:
        plain = os.urandom(length)
        fd, path = tempfile.mkstemp(prefix="blockcache-large-reads-")
        os.unlink(path)
        os.pwrite(fd, blockfile.seal("k", plain, _VK), 0)
        cipher = blockfile.BlockCipher.from_head(os.pread(fd, blockfile.HEADER_SIZE, 0), "k",
                                                 _VK, blockfile.key_id(_VK))
        _SEALED[length] = (plain, fd, cipher)
    return _SEALED[length]
