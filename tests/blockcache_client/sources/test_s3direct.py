"""S3 GETs sent directly (s3direct.py) by an S3 volume's Backend: the same
bytes and errors as through s3fs, against a real S3 server on loopback, with
an HTTP front (tests/support/s3front.py) that records which client sent each
GET and injects the answers a real S3 gives under throttling, refusal and
region redirects."""

from __future__ import annotations

import contextlib
import errno
import os
import random

import pytest

from blockcache_client.sources.backend import Backend
from blockcache_client.sources.s3direct import USER_AGENT
from tests.support.s3front import S3Front

KEYS = ["plain.bin", "a b/c+d%e.bin", "x/ü~n.bin", "deep/er/path/f=1&g.bin"]


@pytest.fixture
def front(s3_server):
    with S3Front(s3_server.endpoint_url) as f:
        yield f


@contextlib.contextmanager
def backend_via(front, s3_server, prefix: str, files: dict, **extra):
    """A Backend of s3://bucket/prefix through `front`, after uploading `files`
    ({rel: bytes}); closed on the way out."""
    fs = s3_server.filesystem()
    for rel, data in files.items():
        fs.pipe_file(f"{s3_server.bucket}/{prefix}/{rel}", data)
    opts = dict(s3_server.storage_options, endpoint_url=front.url)
    opts.update(extra)
    b = Backend(s3_server.url(prefix), timeout=10, attempts=3, **opts)
    try:
        yield b
    finally:
        b.close()


def direct_gets(front) -> list[str]:
    return [path for path, agent in front.gets if agent == USER_AGENT]


def test_direct_reads_equal_the_object_for_any_key_and_range(front, s3_server):
    rng = random.Random(1)
    objects = {rel: rng.randbytes(rng.randint(1, 300_000)) for rel in KEYS}
    with backend_via(front, s3_server, "d1", objects) as b:
        assert b._direct is not None
        for rel, data in objects.items():
            n = len(data)
            for start, end in [(0, n), (0, 1), (n // 3, n // 2), (n - 1, n), (n // 2, n + 1000)]:
                assert b.read(rel, start, end) == data[start:end], (rel, start, end)
            info = b.stat(rel)
            parts = b.read_version(rel, 0, n, info.version, piece=65536)
            assert parts == [data[o:o + 65536] for o in range(0, n, 65536)]
        assert b.read(KEYS[0], 5, 5) == b""
        # every ranged GET went out directly, none through s3fs
        gets = [path for path, _ in front.gets if "list-type" not in path]
        assert gets and gets == direct_gets(front)


def test_stored_encoding_is_not_undone(front, s3_server):
    """An object stored with Content-Encoding: gzip is read as its stored bytes,
    as s3fs reads it (the cache keeps what the remote holds)."""
    raw = os.urandom(5000)
    s3_server.filesystem().pipe_file(f"{s3_server.bucket}/d2/z.gz", raw, ContentEncoding="gzip")
    with backend_via(front, s3_server, "d2", {}) as b:
        assert b.read("z.gz", 0, 5000) == raw
        assert direct_gets(front)


def test_a_changed_etag_is_estale_and_a_missing_key_enoent(front, s3_server):
    with backend_via(front, s3_server, "d3", {"f.bin": b"x" * 1000}) as b:
        info = b.stat("f.bin")
        s3_server.filesystem().pipe_file(f"{s3_server.bucket}/d3/f.bin", b"y" * 1000)
        with pytest.raises(OSError) as e:
            b.read_version("f.bin", 0, 1000, info.version)
        assert e.value.errno == errno.ESTALE and "f.bin" in str(e.value)
        with pytest.raises(FileNotFoundError) as e:
            b.read("gone.bin", 0, 10)
        assert e.value.errno == errno.ENOENT and "gone.bin" in str(e.value)
        assert len(direct_gets(front)) == 2  # neither was retried or repeated via s3fs
        assert b._direct is not None


def test_throttling_is_retried_and_a_refusal_is_not(front, s3_server):
    with backend_via(front, s3_server, "d4", {"f.bin": b"abc" * 100}) as b:
        front.fail_gets(503, times=2)
        assert b.read("f.bin", 0, 300) == b"abc" * 100
        assert len(direct_gets(front)) == 3
        front.fail_gets(403)
        with pytest.raises(PermissionError) as e:
            b.read("f.bin", 0, 300)
        assert e.value.errno == errno.EACCES and "f.bin" in str(e.value)
        assert len(direct_gets(front)) == 4
        assert b.read("f.bin", 0, 3) == b"abc"  # the connection pool is still sound


@pytest.mark.parametrize("status", [301, 400])
def test_a_bucket_in_another_region_is_read_there(front, s3_server, status):
    """S3's answer to a GET signed for the wrong region names the bucket's
    region: the read is signed again for it, and so is every later one."""
    with backend_via(front, s3_server, "d9", {"f.bin": b"0123456789"}) as b:
        front.fail_gets(status, headers={"x-amz-bucket-region": "eu-west-3"})
        assert b.read("f.bin", 2, 6) == b"2345"
        assert b.read("f.bin", 0, 3) == b"012"
        assert b._direct is not None
        assert len(direct_gets(front)) == 3
        assert front.regions == ["us-east-1", "eu-west-3", "eu-west-3"]


def test_another_redirect_hands_the_volume_to_s3fs(front, s3_server):
    """A redirect that names no other region is what s3fs's own client knows
    how to follow: that read, and every later one, goes through s3fs."""
    with backend_via(front, s3_server, "d5", {"f.bin": b"0123456789"}) as b:
        front.fail_gets(301, headers={"x-amz-bucket-region": "us-east-1"})
        assert b.read("f.bin", 2, 6) == b"2345"
        assert b._direct is None
        assert b.read("f.bin", 0, 10) == b"0123456789"
        version = b.stat("f.bin").version
        assert b.read_version("f.bin", 0, 10, version, piece=4) == [b"0123", b"4567", b"89"]
        agents = [agent for _, agent in front.gets]
        assert agents[0] == USER_AGENT and USER_AGENT not in agents[1:]


def test_a_forked_child_reads_directly_on_its_own_connections(front, s3_server):
    with backend_via(front, s3_server, "d6", {"f.bin": b"parent and child"}) as b:
        assert b.read("f.bin", 0, 6) == b"parent"  # the parent's pool holds a connection
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            code = 1
            try:
                ok = b.read("f.bin", 11, 16) == b"child" and b._direct is not None
                os.write(w, b"ok" if ok else b"bad")
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        got = os.read(r, 10)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        assert got == b"ok" and status == 0
        assert b.read("f.bin", 7, 10) == b"and"
        assert len(direct_gets(front)) == 3


@pytest.mark.parametrize("extra", [{"version_aware": True},
                                   {"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}},
                                   {"requester_pays": True}])
def test_requests_that_need_more_than_a_plain_get_stay_with_s3fs(front, s3_server, extra):
    with backend_via(front, s3_server, "d7", {"f.bin": b"kept by s3fs"}, **extra) as b:
        assert b._direct is None
        assert b.read("f.bin", 0, 12) == b"kept by s3fs"
        assert front.gets and not direct_gets(front)
    with backend_via(front, s3_server, "d7", {}) as plain:  # the same volume without them
        assert plain.read("f.bin", 0, 4) == b"kept"
        assert len(direct_gets(front)) == 1


def test_the_direct_path_can_be_switched_off(front, s3_server, monkeypatch):
    monkeypatch.setenv("BLOCKCACHE_S3_DIRECT", "0")
    with backend_via(front, s3_server, "d8", {"f.bin": b"through s3fs"}) as b:
        assert b._direct is None
        assert b.read("f.bin", 0, 12) == b"through s3fs"
        assert front.gets and not direct_gets(front)
    monkeypatch.setenv("BLOCKCACHE_S3_DIRECT", "1")
    with backend_via(front, s3_server, "d8", {}) as b:  # switched on again
        assert b.read("f.bin", 0, 7) == b"through"
        assert len(direct_gets(front)) == 1
