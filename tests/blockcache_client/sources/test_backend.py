"""Backend: path normalization, FileInfo, retries, timeouts and error mapping."""

from __future__ import annotations

import errno
import random
import threading
import time

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given
from hypothesis import strategies as st

from blockcache_client.sources.backend import Backend
from blockcache_client.sources.fileinfo import FileInfo, is_canonical_name, normalize


@pytest.mark.parametrize("path,want", [("", ""), ("/", ""), ("a", "a"), ("/a/b/", "a/b"),
                                       ("a//b", "a/b"), ("a/.hidden", "a/.hidden"),
                                       ("a/..b", "a/..b"), ("...", "..."),
                                       # only '/' separates: a backslash is part of a name
                                       ("a\\..\\b", "a\\..\\b"), ("\\", "\\")])
def test_normalize(path, want):
    assert normalize(path) == want


@pytest.mark.parametrize("path", ["..", "../a", "a/../../b", "a/..", "./a", "a/./b", "a\0b"])
def test_normalize_refuses_escapes(path):
    with pytest.raises(OSError) as e:
        normalize(path)
    assert e.value.errno == errno.EINVAL


@given(st.text(alphabet="ab./\\\0", max_size=6))
def test_a_canonical_name_is_one_component_normalize_keeps(name):
    try:
        kept = normalize(name) == name and "/" not in name and name != ""
    except OSError:
        kept = False
    assert is_canonical_name(name) == kept


def test_normalize_type():
    with pytest.raises(TypeError):
        normalize(b"a")


def test_file_info_local(local_source):
    local_source.write("d/f.bin", b"x" * 1234)
    b = Backend(local_source.url)
    try:
        info = b.stat("d/f.bin")
        assert isinstance(info, FileInfo)
        assert (info.path, info.name, info.size, info.is_dir, info.is_link) == \
            ("d/f.bin", "f.bin", 1234, False, False)
        assert info.version == f"{info.mtime_ns}-1234" and info.mtime_ns > 0
        assert info.mode is not None and info.mode & 0o400
        root = b.stat("")
        assert root.path == "" and root.is_dir
        assert [i.path for i in b.listdir("d")] == ["d/f.bin"]
        assert b.read("d/f.bin", 1000, 2000) == b"x" * 234
        with pytest.raises(FileNotFoundError) as e:
            b.stat("d/nope")
        assert e.value.errno == errno.ENOENT and "d/nope" in str(e.value)
        with pytest.raises(FileNotFoundError):
            b.read("d/nope", 0, 10)
        with pytest.raises(IsADirectoryError):
            b.read("d", 0, 10)
    finally:
        b.close()


@pytest.mark.parametrize("prefix", ["", "bk", "bk/deeper"])
def test_s3_paths_split_as_s3fs_splits_them(s3_server, prefix):
    fs = s3_server.filesystem()
    fs.pipe(f"{s3_server.bucket}/{prefix}/a b/c+d.bin".replace("//", "/"), b"xyz")
    b = Backend(s3_server.url(prefix), **s3_server.storage_options)
    try:
        assert b._root_key is not None  # the root is split once, paths under it appended
        for rel in ("c.bin", "a b/c+d.bin", "x/y/z", "odd?versionId=1"):
            full = b.full_path(rel)
            assert b._bucket_key(full) == tuple(b.fs.split_path(full)[:2]), rel
        assert b.read("a b/c+d.bin", 0, 3) == b"xyz"
    finally:
        b.close()


def test_file_info_s3_uses_etag(s3_server):
    fs = s3_server.filesystem()
    fs.pipe(f"{s3_server.bucket}/bk/x.bin", b"abc")
    b = Backend(s3_server.url("bk"), **s3_server.storage_options)
    try:
        info = b.stat("x.bin")
        etag = fs.info(f"{s3_server.bucket}/bk/x.bin")["ETag"].strip('"')
        assert info.size == 3 and info.version == etag
        assert info.mtime_ns > 0
        assert b.read("x.bin", 1, 3) == b"bc"
        with pytest.raises(FileNotFoundError):
            b.read("missing.bin", 0, 1)
    finally:
        b.close()


class FlakyFS(MemoryFileSystem):
    """An in-memory store whose next `fail` calls raise `error` or hang."""

    protocol = "flakytest"
    cachable = False
    store: dict = {}          # its own, not MemoryFileSystem's process-wide store
    pseudo_dirs = [""]

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.fail = 0
        self.error: BaseException | None = None
        self.hang = 0.0
        self.calls = 0
        self.lock = threading.Lock()

    def _maybe_fail(self):
        with self.lock:
            self.calls += 1
            failing = self.fail > 0
            self.fail -= 1
        if failing:
            if self.hang:
                time.sleep(self.hang)
            else:
                raise self.error

    def info(self, path, **kw):
        self._maybe_fail()
        return super().info(path, **kw)

    def cat_file(self, path, start=None, end=None, **kw):
        self._maybe_fail()
        return super().cat_file(path, start=start, end=end, **kw)


@pytest.fixture
def flaky():
    fs = FlakyFS()
    fs.pipe("/vol/f.bin", b"0123456789")
    backend = Backend("/vol", fs=fs, timeout=0.5, attempts=4)
    yield fs, backend
    backend.close()
    fs.store.clear()


@pytest.mark.parametrize("error", [ConnectionError("reset"), TimeoutError("slow"),
                                   OSError(errno.EAGAIN, "try again"), RuntimeError("HTTP 503")])
def test_temporary_errors_are_retried(flaky, error):
    fs, b = flaky
    fs.fail, fs.error = 3, error
    assert b.read("f.bin", 2, 5) == b"234"
    assert fs.calls == 4


def test_retry_budget_runs_out(flaky):
    fs, b = flaky
    fs.fail, fs.error = 100, ConnectionError("down")
    with pytest.raises(OSError) as e:
        b.stat("f.bin")
    assert e.value.errno == errno.EIO and "f.bin" in str(e.value) and "4 attempts" in str(e.value)
    assert fs.calls == 4


@pytest.mark.parametrize("error,cls", [(FileNotFoundError(errno.ENOENT, "gone"), FileNotFoundError),
                                       (PermissionError(errno.EACCES, "denied"), PermissionError),
                                       (IsADirectoryError(errno.EISDIR, "dir"), IsADirectoryError)])
def test_permanent_errors_are_not_retried(flaky, error, cls):
    fs, b = flaky
    fs.fail, fs.error = 1, error
    with pytest.raises(cls) as e:
        b.read("f.bin", 0, 1)
    assert e.value.errno == error.errno and "f.bin" in str(e.value)
    assert fs.calls == 1


def test_hung_call_times_out_and_retries(flaky):
    fs, b = flaky
    fs.fail, fs.hang = 1, 2.0
    t0 = time.monotonic()
    assert b.read("f.bin", 0, 3) == b"012"
    assert time.monotonic() - t0 < 2.0  # did not wait for the hung call
    fs.fail, fs.hang = 10, 2.0
    with pytest.raises(OSError) as e:
        b.read("f.bin", 0, 3)
    assert e.value.errno == errno.ETIMEDOUT


def test_chained_url_and_bad_source(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hi")
    b = Backend(f"latency::file://{tmp_path}", latency={"delay": 0})
    try:
        assert b.read("a.txt", 0, 10) == b"hi"
    finally:
        b.close()
    with pytest.raises(ValueError, match="nosuchproto"):
        Backend("nosuchproto://x")
    assert fsspec.get_filesystem_class("latency")


def test_hung_s3_server_times_out():
    """An async backend (s3fs) is bounded by fsspec's own loop timeout."""
    import signal

    from devtools.s3server import S3Server
    with S3Server() as server:
        server.filesystem().pipe(f"{server.bucket}/h/x.bin", b"abc")
        b = Backend(server.url("h"), timeout=1.0, attempts=2, skip_instance_cache=True,
                    **server.storage_options)
        try:
            assert b._async and b.read("x.bin", 0, 3) == b"abc"
            server.proc.send_signal(signal.SIGSTOP)  # a remote that stops answering
            try:
                t0 = time.monotonic()
                with pytest.raises(OSError) as e:
                    b.read("x.bin", 0, 3)
                assert e.value.errno == errno.ETIMEDOUT and "x.bin" in str(e.value)
                assert time.monotonic() - t0 < 10
            finally:
                server.proc.send_signal(signal.SIGCONT)
            assert b.read("x.bin", 0, 3) == b"abc"
        finally:
            b.close()


def test_read_version_in_parts(source):
    """A coalesced read comes back as block-sized parts (S3: read off the
    connection part by part; local: one pread each), and a changed file is
    ESTALE however it is read."""
    check_parts(source, native=True)


def test_read_version_in_parts_through_the_stat_fallback(local_source):
    """Any other filesystem (here latency::, no delay): read, stat, split."""
    local_source.url = f"latency::file://{local_source.root}"
    local_source.options = {"latency": {"delay": 0}}
    check_parts(local_source, native=False)


def check_parts(source, native: bool) -> None:
    data = random.Random(7).randbytes(10 * 1000 + 17)
    source.write("p.bin", data)
    be = Backend(source.url, **source.options)
    try:
        assert be.native_versioned_reads == native
        version = be.stat("p.bin").version
        parts = be.read_version("p.bin", 1000, len(data), version, piece=3000)
        assert [len(p) for p in parts] == [3000, 3000, 3000, 17]
        assert b"".join(parts) == data[1000:]
        assert be.read_version("p.bin", 0, 10, version) == data[:10]  # no piece: bytes
        source.write("p.bin", random.Random(8).randbytes(len(data)))
        with pytest.raises(OSError) as e:
            be.read_version("p.bin", 0, len(data), version, piece=3000)
        assert e.value.errno == errno.ESTALE and "p.bin" in str(e.value)
    finally:
        be.close()
