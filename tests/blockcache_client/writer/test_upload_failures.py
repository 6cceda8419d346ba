"""Uploads that fail: the remote refuses, goes down, or stalls mid-upload.
Close answers EIO, and nothing partial is left: no object under the name (the
old one, if any, untouched), no staged bytes, and no multipart upload where
the abort could reach the remote."""

from __future__ import annotations

import errno
import os
import shutil
import time

import pytest

from blockcache_client import Volume
from tests.blockcache_client.conftest import S3Source
from tests.support.s3front import S3Front
from tests.support.s3objects import straight, uploads_left
from tests.support.volumes import volume

MiB = 1 << 20
STALL = 8.0  # a part held this long: well past the volume's timeout of 2 s


@pytest.fixture
def staging(tmp_path):
    path = tmp_path / "staging"
    path.mkdir()
    return path


@pytest.fixture
def front(s3_server):
    with S3Front(s3_server.endpoint_url) as f:
        yield f


def s3_writer(s3_server, front, key_file, tmp_path, **kw):
    """A volume on a fresh prefix, reached through `front` (few retries: the
    failures are meant to last)."""
    source = S3Source(s3_server)
    opts = dict(source.options, endpoint_url=front.url,
                config_kwargs={"retries": {"max_attempts": 1}}, attempts=1)
    vol = Volume("vol", source.url, key_file, socket_path="/nonexistent.sock",
                 staging_dir=str(tmp_path), upload_part_bytes=5 * MiB, **{**opts, **kw})
    return source, vol


def write_and_close(vol, rel, data):
    f = vol.open(rel, "wb")
    f.write(data)
    with pytest.raises(OSError) as err:
        f.close()
    return err.value


def nothing_staged(vol, staging):
    assert vol.stats()["staging_used_bytes"] == 0 and vol.stats()["staged_files"] == 0
    assert os.listdir(staging) == []


@pytest.mark.parametrize("size,where", [(MiB, "PUT /"), (12 * MiB, "partNumber=2")],
                         ids=["one-put", "multipart"])
def test_a_remote_that_refuses(s3_server, front, key_file, staging, size, where):
    source, vol = s3_writer(s3_server, front, key_file, staging)
    with vol:
        source.write("ckpt.bin", b"the old checkpoint")
        front.fail_writes(403, where if where != "PUT /" else f"/{source.prefix}/ckpt.bin")
        err = write_and_close(vol, "ckpt.bin", os.urandom(size))
        assert err.errno == errno.EIO and "ckpt.bin" in str(err)
        assert straight(source, "ckpt.bin") == b"the old checkpoint"
        assert uploads_left(s3_server, source) == []  # aborted
        assert vol.stats()["uploads_failed"] == 1 and vol.stats()["uploads"] == 0
        nothing_staged(vol, staging)


def test_a_remote_that_goes_down_mid_upload(s3_server, front, key_file, staging):
    source, vol = s3_writer(s3_server, front, key_file, staging, timeout=5)
    with vol:
        front.down_at_write("partNumber=2")  # part 1 may land; then nothing does
        f = vol.open("ckpt.bin", "wb")  # (its stat reaches the remote: before it goes down)
        f.write(os.urandom(12 * MiB))  # staged here; the upload is close's
        start = time.monotonic()
        with pytest.raises(OSError) as raised:
            f.close()
        err = raised.value
        assert err.errno == errno.EIO and time.monotonic() - start < 60
        assert front.down  # (part 2 came, and found the remote gone)
        assert straight(source, "ckpt.bin") is None
        # if the upload had begun, the abort could not reach it either: its
        # parts stay, never an object, for the bucket's
        # AbortIncompleteMultipartUpload rule (docs/deploy.md)
        assert len(uploads_left(s3_server, source)) <= 1
        nothing_staged(vol, staging)
        front.down = False
        front.clear_writes()
        with vol.open("after.bin", "wb") as f:  # back up: writes work again
            f.write(b"ok")
        assert straight(source, "after.bin") == b"ok"


def test_a_remote_that_stalls_mid_upload(s3_server, front, key_file, staging):
    source, vol = s3_writer(s3_server, front, key_file, staging, timeout=2)
    with vol:
        front.stall_writes(STALL, "partNumber=2")
        start = time.monotonic()
        err = write_and_close(vol, "ckpt.bin", os.urandom(12 * MiB))
        assert err.errno == errno.EIO and time.monotonic() - start < STALL  # (the timeout)
        front.clear_writes()
        assert straight(source, "ckpt.bin") is None
        time.sleep(STALL)  # the stalled part lands after the abort: still no object
        assert straight(source, "ckpt.bin") is None
        nothing_staged(vol, staging)


def test_a_local_directory_that_goes_away_mid_write(local_source, key_file, staging):
    with volume(local_source, key_file, None, staging_dir=str(staging)) as vol:
        vol.mkdir("run")
        f = vol.open("run/ckpt.bin", "wb")
        f.write(os.urandom(MiB))
        shutil.rmtree(os.path.join(local_source.root, "run"))
        with pytest.raises(OSError) as err:
            f.close()
        assert err.value.errno == errno.EIO
        assert os.listdir(local_source.root) == []
        nothing_staged(vol, staging)


def test_a_failed_local_upload_leaves_no_temp_file(local_source, key_file, staging):
    with volume(local_source, key_file, None, staging_dir=str(staging)) as vol:
        os.mkdir(os.path.join(local_source.root, "ckpt.bin"))  # a directory in the way
        with vol.open("other.bin", "wb") as f:
            f.write(b"x")
        f = vol.open("ckpt2.bin", "wb")
        f.write(b"y" * 1000)
        os.rename(os.path.join(local_source.root, "ckpt.bin"),
                  os.path.join(local_source.root, "ckpt2.bin"))  # now the name is a dir
        with pytest.raises(OSError) as err:
            f.close()
        assert err.value.errno == errno.EIO
        assert sorted(os.listdir(local_source.root)) == ["ckpt2.bin", "other.bin"]
        assert os.path.isdir(os.path.join(local_source.root, "ckpt2.bin"))
        nothing_staged(vol, staging)
