"""A staged file alone: any write pattern against a bytearray model, sealed at
rest, nameless, bounded (ENOSPC naming the setting), unreadable by other uids."""

from __future__ import annotations

import errno
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockcache_client.contract.errors import ConfigError
from blockcache_client.writer.stagedfile import KEPT_UNITS, UNIT, StagedFile
from blockcache_client.writer.staging import StagingArea
from tests.support.uids import ChildError, as_uid

KEY = bytes(range(32))
CHUNK = 64 << 10
NOBODY = 65534


def staged(tmp_path, limit=1 << 30) -> StagedFile:
    area = StagingArea(str(tmp_path), limit, "vol")
    return StagedFile(area, KEY, CHUNK, "a/file.bin")


def snapshot_bytes(f: StagedFile) -> bytes:
    """What an upload would send: the file flushed, read from its sealed units."""
    with f.lock:
        f.flush()
        snap = f.snapshot()
        out = bytearray(snap.size)
        snap.read_into(0, memoryview(out), bytearray(f.stride))
    return bytes(out)


# offsets around unit edges, and far enough to pass the units kept in memory
_offsets = st.one_of(st.integers(0, (KEPT_UNITS + 2) * UNIT),
                     st.sampled_from([0, 1, UNIT - 1, UNIT, UNIT + 1, 2 * UNIT, 5 * UNIT - 3]))
_ops = st.lists(st.one_of(
    st.tuples(st.just("write"), _offsets, st.integers(0, 2 * UNIT + 5)),
    st.tuples(st.just("truncate"), _offsets, st.just(0)),
    st.tuples(st.just("read"), _offsets, st.integers(0, 2 * UNIT)),
), max_size=12)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=_ops, seed=st.integers(0, 255))
def test_any_write_pattern_reads_back_as_a_bytearray_would(tmp_path_factory, ops, seed):
    f = staged(tmp_path_factory.mktemp("staging"))
    model = bytearray()
    try:
        for i, (op, offset, n) in enumerate(ops):
            if op == "write":
                data = bytes([(seed + i) % 251 + 1]) * n
                f.write(offset, data)
                if offset > len(model) and n:  # as pwrite: 0 bytes extend nothing
                    model.extend(bytes(offset - len(model)))
                model[offset:offset + n] = data
            elif op == "truncate":
                f.truncate(offset)
                del model[offset:]
                model.extend(bytes(offset - len(model)))
            else:
                assert f.read(offset, n) == model[offset:offset + n]
            assert f.size == len(model)
        assert snapshot_bytes(f) == model
    finally:
        f.dispose()
    assert f.area.used == 0


def test_staged_bytes_are_sealed_nameless_and_counted(tmp_path):
    f = staged(tmp_path)
    secret = b"plaintext that must not reach the disk " * 5000
    f.write(0, secret)
    f.write(3 * UNIT + 7, secret)  # a gap: a hole, no disk, no budget
    f.flush()
    assert os.listdir(tmp_path) == []  # O_TMPFILE: no name to open
    with open(f"/proc/self/fd/{f.fd}", "rb") as raw:
        on_disk = raw.read()
    assert b"plaintext that must not" not in on_disk
    assert f.area.used == 2 * f.stride  # units 0 and 3
    assert f.read(0, len(secret)) == secret
    assert f.read(UNIT, 100) == bytes(100)
    f.dispose()
    assert f.area.used == 0


def test_a_unit_changed_on_the_staging_disk_fails_as_eio(tmp_path):
    f = staged(tmp_path)
    f.write(0, b"x" * (UNIT + 10))
    f.flush()
    f.write(5 * UNIT, b"y")  # pushes units out of memory: reads come from disk
    for i in range(6, 6 + KEPT_UNITS):
        f.write(i * UNIT, b"z")
    blob = bytearray(os.pread(f.fd, 200, 0))
    blob[100] ^= 1
    os.pwrite(f.fd, bytes(blob), 0)
    with pytest.raises(OSError) as err:
        f.read(0, 10)
    assert err.value.errno == errno.EIO and "not as written" in str(err.value)
    f.dispose()


def test_a_bound_of_nothing_or_a_missing_dir_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="staging_bytes must be a positive"):
        StagingArea(str(tmp_path), 0, "vol")
    with pytest.raises(ConfigError, match="staging directory .*nowhere.*staging_dir"):
        StagingArea(str(tmp_path / "nowhere"), 1 << 20, "vol")


def test_enospc_changes_nothing_and_room_comes_back(tmp_path):
    area = StagingArea(str(tmp_path), 1, "vol")
    area.limit = 2 * StagedFile(area, KEY, CHUNK, "probe").stride  # room for two units
    f = StagedFile(area, KEY, CHUNK, "ckpt.bin")
    f.write(0, b"a" * (2 * UNIT))
    with pytest.raises(OSError) as err:
        f.write(2 * UNIT, b"b" * 10)
    assert err.value.errno == errno.ENOSPC
    assert "staging_bytes" in str(err.value) and "ckpt.bin" in str(err.value)
    assert f.size == 2 * UNIT and f.read(2 * UNIT - 1, 5) == b"a"
    f.truncate(UNIT)
    f.write(UNIT, b"b" * 10)  # the unit the truncate freed
    assert f.read(UNIT - 1, 20) == b"a" + b"b" * 10
    f.dispose()
    assert area.used == 0


def test_another_uid_cannot_read_a_staged_file(tmp_path):
    f = staged(tmp_path)
    f.write(0, b"secret")
    f.flush()
    path = f"/proc/{os.getpid()}/fd/{f.fd}"

    def peek():
        with open(path, "rb") as raw:
            return raw.read()
    with pytest.raises(ChildError) as err:
        as_uid(NOBODY, NOBODY, peek)
    assert err.value.kind == "PermissionError"
    f.dispose()
