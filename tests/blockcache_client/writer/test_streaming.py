"""Parts sent while a file is written: a sequential writer's parts reach the
remote before its close, and whatever it does after that (a seek back, a
truncate, a rename, dropping the file) the object is exactly the file as
closed, or nothing, with no multipart upload left behind."""

from __future__ import annotations

import os
import time

import pytest

from blockcache_client import Volume
from tests.blockcache_client.conftest import S3Source
from tests.support.s3front import S3Front
from tests.support.s3objects import straight, uploads_left

MiB = 1 << 20
PART = 5 * MiB


@pytest.fixture
def front(s3_server):
    with S3Front(s3_server.endpoint_url) as f:
        yield f


@pytest.fixture
def vol(s3_server, front, key_file, tmp_path):
    source = S3Source(s3_server)
    v = Volume("vol", source.url, key_file, socket_path="/nonexistent.sock",
               staging_dir=str(tmp_path), upload_part_bytes=PART,
               **dict(source.options, endpoint_url=front.url))
    v.source = source
    try:
        yield v
    finally:
        v.close()


def parts_sent(front) -> int:
    return sum(1 for method, path in front.requests if method == "PUT" and "partNumber=" in path)


def wait_parts(front, n: int) -> None:
    deadline = time.monotonic() + 30
    while parts_sent(front) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_sequential_writer_s_parts_go_before_its_close(vol, front):
    data = os.urandom(6 * PART + 123)
    f = vol.open("ckpt.bin", "wb")
    for off in range(0, len(data), MiB):
        f.write(data[off:off + MiB])
    wait_parts(front, 4)
    sent_ahead = parts_sent(front)
    assert sent_ahead >= 4  # the writer is past them: sent while it wrote
    assert straight(vol.source, "ckpt.bin") is None  # parts are no object
    f.close()
    assert straight(vol.source, "ckpt.bin") == data
    assert parts_sent(front) == 7  # each once: none sent ahead was sent again


def test_a_part_written_again_after_it_was_sent_is_sent_again(vol, front, s3_server):
    data = bytearray(os.urandom(6 * PART))
    f = vol.open("model.pt", "wb")
    for off in range(0, len(data), MiB):
        f.write(data[off:off + MiB])
    wait_parts(front, 4)
    f.seek(10)  # zipfile patching a local header
    f.write(b"patched!")
    data[10:18] = b"patched!"
    f.truncate(5 * PART + 7)  # and a truncate into the last part
    del data[5 * PART + 7:]
    f.close()
    assert straight(vol.source, "model.pt") == bytes(data)
    assert uploads_left(s3_server, vol.source) == []


def test_a_file_dropped_after_parts_went_leaves_nothing(vol, front, s3_server):
    f = vol.open("half.bin", "wb")
    for _ in range(5 * PART // MiB):
        f.write(os.urandom(MiB))
    wait_parts(front, 2)
    f.discard()
    deadline = time.monotonic() + 30
    while uploads_left(s3_server, vol.source) and time.monotonic() < deadline:
        time.sleep(0.05)  # (aborted in the background)
    assert uploads_left(s3_server, vol.source) == []
    assert straight(vol.source, "half.bin") is None
    g = vol.open("gone.bin", "wb")
    for _ in range(5 * PART // MiB):
        g.write(os.urandom(MiB))
    wait_parts(front, 4)
    vol.unlink("gone.bin")
    g.close()
    deadline = time.monotonic() + 30
    while uploads_left(s3_server, vol.source) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uploads_left(s3_server, vol.source) == [] and straight(vol.source, "gone.bin") is None


def test_a_file_renamed_while_open_after_parts_went(vol, front, s3_server):
    data = os.urandom(5 * PART + 99)
    f = vol.open(".tmp123", "wb")
    f.write(data)
    wait_parts(front, 2)
    vol.rename(".tmp123", "model.safetensors")
    f.close()
    assert straight(vol.source, "model.safetensors") == data
    assert straight(vol.source, ".tmp123") is None
    deadline = time.monotonic() + 30
    while uploads_left(s3_server, vol.source) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uploads_left(s3_server, vol.source) == []
