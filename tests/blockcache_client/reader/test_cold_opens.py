"""Cold directories on S3: a file this process never saw, in a directory whose
files were just fetched from the source, is opened by its first block's GET
(no HEAD, no listing); a warm directory is still checked by one listing and
no GET. Against a real moto server seen through an HTTP front that records
every request, and a real daemon."""

from __future__ import annotations

import errno
import random
import time
import uuid

import pytest

from tests.support.s3front import S3Front
from tests.support.volumes import BS, settle, volume, wait_connected

# small files (one block), a multi-block one, and an empty one, in two directories
SIZES = [BS // 2, 1, BS, 3 * BS + 5, BS - 3, 0, 2 * BS, 777]


@pytest.fixture
def front(s3_server):
    with S3Front(s3_server.endpoint_url) as f:
        yield f


class Dataset:
    """Files under a fresh prefix of the moto bucket, read through `front`."""

    def __init__(self, s3_server, front):
        self.prefix = f"cold-{uuid.uuid4().hex[:10]}"
        self.fs = s3_server.filesystem()
        self.base = f"{s3_server.bucket}/{self.prefix}"
        self.url = s3_server.url(self.prefix)
        self.options = dict(s3_server.storage_options, endpoint_url=front.url)
        self.front = front
        rng = random.Random(5)
        self.files = {f"{d}/f{i:02d}.bin": rng.randbytes(n)
                      for d in ("a", "b") for i, n in enumerate(SIZES)}
        for rel, data in self.files.items():
            self.write(rel, data)

    def write(self, rel: str, data: bytes) -> None:
        self.fs.pipe(f"{self.base}/{rel}", data)

    def requests(self) -> dict[str, list[str]]:
        """What the server saw since the last call, by kind: `head`s,
        `list`ings and object `get`s (paths under the prefix)."""
        seen, self.front.requests[:] = list(self.front.requests), []
        out: dict[str, list[str]] = {"head": [], "list": [], "get": []}
        for method, path in seen:
            if method == "HEAD":
                out["head"].append(path)
            elif method == "GET" and ("list-type" in path or "prefix=" in path):
                out["list"].append(path)
            elif method == "GET":
                out["get"].append(path.partition(f"/{self.prefix}/")[2])
        return out

    def read_all(self, vol) -> None:
        """Each file opened and read whole, in order, equal to the source."""
        for rel, data in self.files.items():
            with vol.open(rel) as f:
                assert f.read() == data, rel


@pytest.fixture
def dataset(s3_server, front):
    return Dataset(s3_server, front)


def _volume(ds, key_file, daemon, **kw):
    vol = volume(ds, key_file, daemon, **kw)
    wait_connected(vol)
    ds.requests()  # the volume's own start (its root's stat) is not a file's
    return vol


def test_cold_directories_are_read_with_gets_only(dataset, key_file, daemon):
    with _volume(dataset, key_file, daemon) as vol:
        dataset.read_all(vol)
        seen = dataset.requests()
        # the first file of each directory is stat-ed and finds it cold;
        # every other file is opened by its first block's GET, but an empty
        # one (S3 answers its range 416, without an ETag): it is stat-ed
        assert seen["list"] == []
        assert sorted(seen["head"]) == sorted(f"/{dataset.base}/{d}/{f}.bin"
                                              for d in "ab" for f in ("f00", "f05"))
        assert vol.stats()["cold_opens"] == len(dataset.files) - 4
        # one GET a file (the empty one's stat-less GET too), one more for
        # the blocks after the first of each multi-block file
        more = sum(1 for d in dataset.files.values() if len(d) > BS)
        assert len(seen["get"]) == len(dataset.files) + more
        s = vol.stats()  # no request but those: nothing is fetched twice
        assert s["backend_requests"] == len(dataset.files) - 2 + more
        assert s["hits"] + s["misses"] == sum(-(-len(d) // BS) for d in dataset.files.values())
        # what the GET told equals what a stat tells
        for rel in dataset.files:
            got = vol.stat(rel)
            fresh = vol.backend.stat(rel)
            assert (got.size, got.version, got.mtime_ns, got.is_dir) == \
                   (fresh.size, fresh.version, fresh.mtime_ns, fresh.is_dir)
        settle(vol, daemon)
    # every block went to the cache under the ETag's keys: a new reader hits them all
    with _volume(dataset, key_file, daemon) as warm:
        dataset.read_all(warm)
        s = warm.stats()
        assert s["misses"] == 0 and s["backend_requests"] == 0 and s["cold_opens"] == 0


def test_a_warm_epoch_lists_each_directory_once_and_gets_nothing(dataset, key_file, daemon):
    with _volume(dataset, key_file, daemon, meta_ttl=1.0) as vol:
        dataset.read_all(vol)
        assert dataset.requests()["list"] == []
        settle(vol, daemon)
        time.sleep(1.1)  # every version is old now: the same reader checks them again
        dataset.read_all(vol)
        seen = dataset.requests()
        assert seen["get"] == [] and seen["head"] == [] and len(seen["list"]) == 2
    # a new reader (a DataLoader worker) on the warm cache: the first file of
    # each directory is stat-ed, the second lists it; no file is fetched
    with _volume(dataset, key_file, daemon) as fresh:
        dataset.read_all(fresh)
        seen = dataset.requests()
        assert seen["get"] == [] and len(seen["list"]) == 2 and len(seen["head"]) == 2
        assert fresh.stats()["cold_opens"] == 0


def test_a_file_changed_at_the_source_gives_new_bytes_or_estale(dataset, key_file, daemon):
    big = "a/f03.bin"  # 3 blocks and a bit: its other blocks are ranged GETs
    old = dataset.files[big]
    new = bytes(b ^ 0xFF for b in old)
    with _volume(dataset, key_file, daemon) as vol:
        with vol.open("a/f00.bin") as f:  # finds the directory cold
            f.read()
        dataset.requests()
        f = vol.open(big)  # its first block and its version, from one GET
        seen = dataset.requests()
        assert seen["head"] == seen["list"] == [] and seen["get"] == [big]
        dataset.write(big, new)
        with pytest.raises(OSError) as exc:  # the rest is not of the version opened
            f.read()
        assert exc.value.errno == errno.ESTALE
        f.close()
        with vol.open(big) as f:  # the version that failed is forgotten
            assert f.read() == new
        # a small file changed after its open: its one GET held all of it
        small = "a/f04.bin"
        with vol.open(small) as f:
            dataset.write(small, b"changed")
            assert f.read() == dataset.files[small]
        dataset.files.update({big: new, small: b"changed"})
        settle(vol, daemon)
    with _volume(dataset, key_file, daemon, memory_cache_bytes=0) as fresh:
        dataset.read_all(fresh)  # new versions, new keys: never the old blocks


def test_missing_files_and_directories_in_a_cold_directory(dataset, key_file, daemon):
    dataset.write("a/sub/inner.bin", b"inner")
    with _volume(dataset, key_file, daemon) as vol:
        with vol.open("a/f00.bin") as f:
            f.read()
        with pytest.raises(FileNotFoundError):
            vol.open("a/nope.bin")
        assert "a/nope.bin" in dataset.requests()["get"]  # tried by its GET first
        with pytest.raises(IsADirectoryError):
            vol.open("a/sub")
        with pytest.raises(FileNotFoundError):  # remembered as missing: no request
            vol.open("a/nope.bin")
        with vol.open("a/sub/inner.bin") as f:
            assert f.read() == b"inner"
        for rel in list(dataset.files)[1:4]:
            with vol.open(rel) as f:
                assert f.read() == dataset.files[rel]
