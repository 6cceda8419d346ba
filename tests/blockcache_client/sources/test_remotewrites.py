"""The sources' writes on their own: which sources can be written, S3's
conditional copy and directory markers, local temp files no other uid reads."""

from __future__ import annotations

import dataclasses
import errno
import os

import pytest

from blockcache_client.sources.backend import Backend
from blockcache_client.sources.remotewrites import writes_for
from tests.blockcache_client.conftest import LocalSource, S3Source
from tests.support.uids import ChildError, as_uid

NOBODY = 65534


def test_only_s3_and_local_directories_can_be_written(tmp_path):
    backend = Backend("memory://somewhere")
    with pytest.raises(OSError) as err:
        writes_for(backend)
    assert err.value.errno == errno.EROFS and "memory://somewhere" in str(err.value)
    assert writes_for(Backend(str(tmp_path))).renames_dirs


def test_s3_rename_copies_only_the_version_seen(s3_server):
    source = S3Source(s3_server)
    backend = Backend(source.url, **source.options)
    writes = writes_for(backend)
    source.write("a.bin", b"version one")
    seen = backend.stat("a.bin")
    source.write("a.bin", b"version two, written meanwhile")
    try:  # S3 refuses the copy (CopySourceIfMatch); moto copies the new version
        assert writes.rename("a.bin", "b.bin", seen) is None  # ...said to be unknown
        assert source.fs.cat(f"{source.base}/b.bin") == b"version two, written meanwhile"
        source.write("a.bin", b"version three")
    except OSError:
        assert not source.fs.exists(f"{source.base}/b.bin")
    now = backend.stat("a.bin")
    info = writes.rename("a.bin", "b.bin", now)
    assert info.version == backend.stat("b.bin").version and info.size == now.size
    assert not source.fs.exists(f"{source.base}/a.bin")


def test_s3_directories_are_markers_and_outlive_their_last_file(s3_server):
    source = S3Source(s3_server)
    backend = Backend(source.url, **source.options)
    writes = writes_for(backend)
    writes.mkdir("empty")
    assert backend.stat("empty").is_dir
    assert "empty" in [i.name for i in backend.listdir("")]
    assert backend.listdir("empty") == []
    source.write("implied/f.bin", b"x")  # a directory only its key implies
    writes.unlink("implied/f.bin")
    assert backend.stat("implied").is_dir  # kept, as on a local disk
    writes.rmdir("implied")
    writes.rmdir("empty")
    with pytest.raises(FileNotFoundError):
        backend.stat("empty")
    with pytest.raises(FileNotFoundError):
        backend.stat("implied")


def test_local_rename_says_nothing_of_a_file_changed_since_seen(tmp_path):
    source = LocalSource(tmp_path / "src")
    backend = Backend(source.url)
    writes = writes_for(backend)
    source.write("a.bin", b"one")
    seen = backend.stat("a.bin")
    assert writes.rename("a.bin", "b.bin", seen).version == seen.version
    stale = dataclasses.replace(backend.stat("b.bin"), version="0-3")
    assert writes.rename("b.bin", "c.bin", stale) is None


def test_a_local_upload_is_hidden_from_other_uids_until_complete(shared_dir):
    root = os.path.join(shared_dir, "vol")
    os.mkdir(root)
    os.chmod(root, 0o755)
    writes = writes_for(Backend(root))
    upload = writes.begin("ckpt.bin")
    upload.part(1, 0, memoryview(b"half of a checkpoint"))
    (temp,) = os.listdir(root)
    assert temp.startswith(".ckpt.bin.blockcache-")
    assert os.stat(os.path.join(root, temp)).st_mode & 0o777 == 0o600

    def peek(path):
        with open(path, "rb") as f:
            return f.read()
    with pytest.raises(ChildError) as err:
        as_uid(NOBODY, NOBODY, peek, os.path.join(root, temp))
    assert err.value.kind == "PermissionError"
    info = upload.complete(20, 1)
    assert os.listdir(root) == ["ckpt.bin"] and info.size == 20
    assert as_uid(NOBODY, NOBODY, peek, os.path.join(root, "ckpt.bin")) == \
        b"half of a checkpoint"  # a whole file now: readable as any new file
    aborted = writes.begin("other.bin")
    aborted.part(1, 0, memoryview(b"x"))
    aborted.abort()
    assert os.listdir(root) == ["ckpt.bin"]


def test_a_local_rewrite_of_the_same_size_gets_a_new_version(tmp_path):
    backend = Backend(str(tmp_path))
    writes = writes_for(backend)
    first = writes.put("f.bin", memoryview(b"aaaa"))
    second = writes.put("f.bin", memoryview(b"bbbb"))  # within one mtime tick, likely
    assert first.version != second.version
    assert backend.stat("f.bin").version == second.version


def test_s3_uploads_are_sent_directly_and_s3fs_takes_what_is_declined(s3_server):
    from tests.support.s3front import S3Front
    with S3Front(s3_server.endpoint_url) as front:
        source = S3Source(s3_server)
        backend = Backend(source.url, **dict(source.options, endpoint_url=front.url))
        writes = writes_for(backend)
        data = os.urandom(6 << 20)
        upload = writes.begin("big.bin")
        upload.part(1, 0, memoryview(data)[:5 << 20])
        front.fail_writes(400, "partNumber=2", times=1)  # the direct PUT is declined once
        upload.part(2, 5 << 20, memoryview(data)[5 << 20:])
        info = upload.complete(len(data), 2)
        assert source.fs.cat(f"{source.base}/big.bin") == data
        assert info.version == backend.stat("big.bin").version
        agents = [(path.partition("?")[2][:12], agent.split("/")[0]) for path, agent in front.puts]
        assert agents[0] == ("partNumber=1", "blockcache-s3direct")
        assert agents[1] == ("partNumber=2", "blockcache-s3direct")  # declined (the 400)...
        assert agents[2][0] == "partNumber=2" and "s3direct" not in agents[2][1]  # ...s3fs's
        writes.put("small.bin", memoryview(b"one PUT"))
        assert front.puts[-1][1] == "blockcache-s3direct"
        assert source.fs.cat(f"{source.base}/small.bin") == b"one PUT"
