"""`Volume` writes against a real daemon, on a local directory and on moto S3:
random write patterns equal a local file written the same way, the object is
absent until close returns, what was written reads warm, and the metadata
changes checkpoint writers make (mkdir, unlink, rename over a name, 0 bytes)."""

from __future__ import annotations

import errno
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockcache_client.writer.stagedfile import UNIT
from tests.support.volumes import settle, volume, wait_connected

MiB = 1 << 20


def remote_bytes(source, rel: str) -> bytes | None:
    """The object at `rel` straight from the remote, or None if there is none."""
    if source.kind == "s3":
        path = f"{source.base}/{rel}"
        source.fs.invalidate_cache()
        return source.fs.cat(path) if source.fs.exists(path) else None
    path = os.path.join(source.root, rel)
    return open(path, "rb").read() if os.path.isfile(path) else None


def writer(source, key_file, daemon, tmp_path, **kw):
    kw.setdefault("upload_part_bytes", 5 * MiB)  # multipart from 5 MiB on
    return volume(source, key_file, daemon, staging_dir=str(tmp_path), **kw)


_ops = st.lists(st.tuples(
    st.sampled_from(["write", "write", "seek_end", "truncate"]),
    st.one_of(st.integers(0, 3 * UNIT), st.sampled_from([0, UNIT - 1, UNIT, 5 * MiB + 1])),
    st.integers(0, UNIT + 100)), max_size=8)


def test_random_write_patterns_equal_a_local_file(source, key_file, daemon, tmp_path):
    with writer(source, key_file, daemon, tmp_path / "staging") as vol:
        os.makedirs(tmp_path / "staging", exist_ok=True)
        count = [0]

        @settings(max_examples=25 if source.kind == "s3" else 60, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(ops=_ops)
        def check(ops):
            count[0] += 1
            rel = f"h/{count[0]}.bin"
            if count[0] == 1:
                vol.mkdir("h")
            local = tmp_path / "model.bin"
            with open(local, "w+b") as model, vol.open(rel, "w+b") as f:
                for i, (op, offset, n) in enumerate(ops):
                    for fobj in (model, f):
                        if op == "write":
                            fobj.seek(offset)
                            fobj.write(bytes([i + 1]) * n)
                        elif op == "seek_end":
                            fobj.seek(0, os.SEEK_END)
                            fobj.write(b"tail%d" % i)
                        else:
                            fobj.truncate(offset)
                    model.seek(0)
                    f.seek(0)
                    assert f.read() == model.read()  # its own bytes, before any upload
                assert remote_bytes(source, rel) is None  # nothing until close returns
                model.seek(0)
                want = model.read()
            assert remote_bytes(source, rel) == want
            assert vol.read(rel, 0, len(want) + 1) == want
        check()
        assert vol.wait_fills(30)
        assert vol.stats()["staging_used_bytes"] == 0


def test_object_absent_until_close_then_read_warm_with_no_remote_bytes(
        source, key_file, daemon, tmp_path):
    data = os.urandom(12 * MiB + 3)
    with writer(source, key_file, daemon, tmp_path) as vol:
        wait_connected(vol)
        vol.mkdir("ckpt")
        f = vol.open("ckpt/model.pt", "wb")
        f.write(data[:100])
        f.write(data[100:])
        assert remote_bytes(source, "ckpt/model.pt") is None
        assert vol.stats()["staging_used_bytes"] > len(data)
        f.close()
        assert remote_bytes(source, "ckpt/model.pt") == data  # in the remote once it returns
        s = vol.stats()
        assert s["uploads"] == 1 and s["uploaded_bytes"] == len(data)
        assert s["staged_bytes"] == len(data) and s["uploads_failed"] == 0
        assert s["upload_ms"] > 0
        settle(vol, daemon)
        assert vol.stats()["staging_used_bytes"] == 0  # dropped once its blocks are cached
    with volume(source, key_file, daemon) as fresh:
        wait_connected(fresh)
        assert fresh.read("ckpt/model.pt", 0, len(data)) == data
        s = fresh.stats()
        assert s["backend_bytes"] == 0 and s["misses"] == 0 and s["hits"] > 0


def test_fsync_uploads_and_the_file_stays_open(source, key_file, daemon, tmp_path):
    with writer(source, key_file, daemon, tmp_path) as vol:
        f = vol.open("log.bin", "wb")
        f.write(b"first")
        info = f.fsync()
        assert remote_bytes(source, "log.bin") == b"first" and info.size == 5
        assert f.fsync() is info  # nothing changed: no second upload
        f.write(b" second")
        assert remote_bytes(source, "log.bin") == b"first"
        f.close()
        assert remote_bytes(source, "log.bin") == b"first second"
        assert vol.stats()["uploads"] == 2


def test_close_to_open_in_this_process(source, key_file, daemon, tmp_path):
    source.write("w.bin", b"old bytes")
    with writer(source, key_file, daemon, tmp_path, meta_ttl=3600) as vol:
        assert vol.open("w.bin").read() == b"old bytes"  # its version cached for an hour
        names = [i.name for i in vol.listdir("")]  # the listing cached for an hour too
        assert "w.bin" in names and "n.bin" not in names
        with vol.open("w.bin", "wb") as f:
            f.write(b"new and longer bytes")
        assert vol.open("w.bin").read() == b"new and longer bytes"
        with vol.open("n.bin", "wb") as f:
            f.write(b"a new file")
        assert "n.bin" in [i.name for i in vol.listdir("")]
        assert vol.stat("n.bin").size == 10


def test_zero_byte_files_are_created_read_and_renamed(source, key_file, daemon, tmp_path):
    with writer(source, key_file, daemon, tmp_path) as vol:
        with vol.open("empty", "wb"):
            pass
        assert remote_bytes(source, "empty") == b""
        assert vol.stat("empty").size == 0 and vol.open("empty").read() == b""
        vol.rename("empty", "still-empty")
        assert remote_bytes(source, "empty") is None
        assert remote_bytes(source, "still-empty") == b""
        assert vol.open("still-empty").read() == b""


def test_dcp_sequence_rename_over_an_existing_name(source, key_file, daemon, tmp_path):
    """Per-rank files with fsync, then `.metadata.tmp` renamed over `.metadata`
    after the old one is deleted, twice: each load sees one whole version."""
    with writer(source, key_file, daemon, tmp_path, meta_ttl=3600) as vol:
        vol.mkdir("step")
        for step in range(2):
            for rank in range(2):
                with vol.open(f"step/__{rank}_0.distcp", "wb") as f:
                    f.write(os.urandom(100_000) + b"rank%d step%d" % (rank, step))
                    f.fsync()
            with vol.open("step/.metadata.tmp", "wb") as f:
                f.write(b"metadata of step %d" % step)
            if step:
                assert vol.open("step/.metadata").read() == b"metadata of step 0"
                vol.unlink("step/.metadata")
            vol.rename("step/.metadata.tmp", "step/.metadata")
            assert vol.open("step/.metadata").read() == b"metadata of step %d" % step
            assert remote_bytes(source, "step/.metadata") == b"metadata of step %d" % step
            assert remote_bytes(source, "step/.metadata.tmp") is None
        # a rename straight over an existing name (safetensors' pattern)
        with vol.open("step/.metadata.tmp", "wb") as f:
            f.write(b"replaced in one rename")
        vol.rename("step/.metadata.tmp", "step/.metadata")
        assert vol.open("step/.metadata").read() == b"replaced in one rename"


def test_a_renamed_file_reads_warm_under_its_new_name(source, key_file, daemon, tmp_path):
    data = os.urandom(3 * MiB + 5)
    with writer(source, key_file, daemon, tmp_path) as vol:
        wait_connected(vol)
        with vol.open("model.safetensors.tmp", "wb") as f:
            f.write(data)
        settle(vol, daemon)
        vol.rename("model.safetensors.tmp", "model.safetensors")
        settle(vol, daemon)
    with volume(source, key_file, daemon) as fresh:
        wait_connected(fresh)
        assert fresh.read("model.safetensors", 0, len(data)) == data
        assert fresh.stats()["backend_bytes"] == 0


def test_metadata_changes_answer_as_a_local_file_system(source, key_file, daemon, tmp_path):
    source.write("d/f.bin", b"x")
    with writer(source, key_file, daemon, tmp_path) as vol:
        cases = [
            (lambda: vol.mkdir("d"), errno.EEXIST),
            (lambda: vol.mkdir("nowhere/sub"), errno.ENOENT),
            (lambda: vol.mkdir("d/f.bin/sub"), errno.ENOTDIR),
            (lambda: vol.rmdir("d"), errno.ENOTEMPTY),
            (lambda: vol.rmdir("d/f.bin"), errno.ENOTDIR),
            (lambda: vol.unlink("d"), errno.EISDIR),
            (lambda: vol.unlink("d/missing"), errno.ENOENT),
            (lambda: vol.rename("d/missing", "d/g"), errno.ENOENT),
            (lambda: vol.rename("d/f.bin", "nowhere/g"), errno.ENOENT),
            (lambda: vol.rename("d/f.bin", "d"), errno.EISDIR),
            (lambda: vol.open("d", "wb"), errno.EISDIR),
            (lambda: vol.open("nowhere/f", "wb"), errno.ENOENT),
            (lambda: vol.open("d/f.bin", "r+b"), errno.EOPNOTSUPP),
            (lambda: vol.open_staged("d/f.bin", truncate=False), errno.EOPNOTSUPP),
        ]
        if source.kind == "s3":
            cases.append((lambda: vol.rename("d", "e"), errno.EXDEV))
        for call, code in cases:
            with pytest.raises(OSError) as err:
                call()
            assert err.value.errno == code, (code, err.value)
        vol.mkdir("e")
        vol.rmdir("e")
        assert vol.stat("d").is_dir
        with pytest.raises(FileNotFoundError):
            vol.stat("e")
        staged = vol.open("d/open.bin", "wb")
        other = vol.open("d/other.bin", "wb")
        with pytest.raises(OSError) as err:
            vol.rename("d/open.bin", "d/other.bin")  # onto a file being written here
        assert err.value.errno == errno.EBUSY and "close it first" in str(err.value)
        other.discard()
        staged.close()
        vol.unlink("d/f.bin")
        vol.unlink("d/open.bin")
        vol.rmdir("d")
        assert remote_bytes(source, "d/f.bin") is None


def test_a_file_renamed_while_open_is_uploaded_under_its_new_name(
        source, key_file, daemon, tmp_path):
    """safetensors 0.8 writes `.tmpXXXX`, renames it over the target, then closes."""
    source.write("model.safetensors", b"the old model")
    with writer(source, key_file, daemon, tmp_path) as vol:
        f = vol.open(".tmpAbC", "wb")
        f.truncate(10)
        f.write(b"new model!")
        vol.rename(".tmpAbC", "model.safetensors")
        assert remote_bytes(source, "model.safetensors") == b"the old model"  # until close
        assert remote_bytes(source, ".tmpAbC") is None
        f.close()
        assert remote_bytes(source, "model.safetensors") == b"new model!"
        assert remote_bytes(source, ".tmpAbC") is None
        g = vol.open("log.txt", "wb")  # uploaded once (fsync), then renamed while open
        g.write(b"first")
        g.fsync()
        vol.rename("log.txt", "log.old")
        assert remote_bytes(source, "log.txt") is None
        assert remote_bytes(source, "log.old") == b"first"
        g.write(b" and more")
        g.close()
        assert remote_bytes(source, "log.old") == b"first and more"


def test_unlinking_a_file_being_written_drops_it(source, key_file, daemon, tmp_path):
    with writer(source, key_file, daemon, tmp_path) as vol:
        f = vol.open("gone.bin", "wb")
        f.write(b"never uploaded")
        vol.unlink("gone.bin")
        f.write(b" still writable")
        f.close()
        assert remote_bytes(source, "gone.bin") is None
        assert vol.stats()["uploads"] == 0 and vol.stats()["staging_used_bytes"] == 0


def test_an_exception_in_the_with_block_uploads_nothing(source, key_file, daemon, tmp_path):
    source.write("keep.bin", b"the whole old checkpoint")
    with writer(source, key_file, daemon, tmp_path) as vol:
        with pytest.raises(RuntimeError):
            with vol.open("keep.bin", "wb") as f:
                f.write(b"half of a new one")
                raise RuntimeError("the job died mid-save")
        assert remote_bytes(source, "keep.bin") == b"the whole old checkpoint"
        assert vol.stats()["staging_used_bytes"] == 0


def test_staging_full_gives_enospc_naming_the_setting(source, key_file, daemon, tmp_path):
    with writer(source, key_file, daemon, tmp_path, staging_bytes=3 * MiB) as vol:
        f = vol.open("big.bin", "wb")
        f.write(b"a" * (2 * MiB))
        with pytest.raises(OSError) as err:
            f.write(b"b" * (2 * MiB))
        assert err.value.errno == errno.ENOSPC and "staging_bytes" in str(err.value)
        f.close()  # what fitted is a whole file
        assert remote_bytes(source, "big.bin") == b"a" * (2 * MiB)


def test_modes_other_than_write_whole_are_refused_clearly(source, key_file, daemon, tmp_path):
    with writer(source, key_file, daemon, tmp_path) as vol:
        with pytest.raises(ValueError, match="'wb'"):
            vol.open("x", "w")
        f = vol.open("x", "wb")
        with pytest.raises(OSError, match="w\\+b"):
            f.read()
        f.discard()
        assert remote_bytes(source, "x") is None
