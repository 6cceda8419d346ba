"""The `blockcached::` fsspec filesystem and the `latency::` wrapper."""

from __future__ import annotations

import random

import fsspec
import pytest

from blockcache_client.fsspec_fs import BlockcachedFileSystem
from devtools.latencyfs import LatencyFileSystem
from tests.support.waiting import wait_for


def test_protocols_come_from_entry_points():
    # registered by the package's entry points, without importing our modules first
    assert fsspec.get_filesystem_class("blockcached") is BlockcachedFileSystem
    assert fsspec.get_filesystem_class("latency") is LatencyFileSystem
    # fsspec's own block cache keeps its name
    from fsspec.implementations.cached import CachingFileSystem
    assert fsspec.get_filesystem_class("blockcache") is CachingFileSystem


def opts(key_file, sock, **kw):
    return {"volume": "vol", "key_file": key_file, "socket_path": sock, "block_size": 64 << 10,
            "skip_instance_cache": True, **kw}


def test_chained_s3_open_cat_ls(s3_server, key_file, daemon):
    s3 = s3_server.filesystem()
    data = random.Random(1).randbytes(200_000)
    s3.pipe(f"{s3_server.bucket}/fsx/dir/a.bin", data)
    s3.pipe(f"{s3_server.bucket}/fsx/dir/b.txt", b"line1\nline2\n")
    url = f"blockcached::s3://{s3_server.bucket}/fsx"
    fs, root = fsspec.core.url_to_fs(url, blockcached=opts(key_file, daemon.socket_path),
                                     s3=s3_server.storage_options)
    assert isinstance(fs, BlockcachedFileSystem) and root == f"{s3_server.bucket}/fsx"
    names = fs.ls(root + "/dir", detail=False)
    assert names == [f"{root}/dir/a.bin", f"{root}/dir/b.txt"]
    assert fs.info(root + "/dir/a.bin")["size"] == len(data)
    assert fs.isdir(root + "/dir") and fs.isfile(root + "/dir/a.bin")
    assert fs.cat(root + "/dir/a.bin") == data
    assert fs.cat_file(root + "/dir/a.bin", 100, 300) == data[100:300]
    assert fs.cat_file(root + "/dir/a.bin", -10) == data[-10:]
    with fs.open(root + "/dir/a.bin") as f:
        f.seek(70_000)
        assert f.read(5) == data[70_000:70_005]
    with fsspec.open(f"{url}/dir/b.txt", "rt", blockcached=opts(key_file, daemon.socket_path),
                     s3=s3_server.storage_options) as f:
        assert f.read().splitlines() == ["line1", "line2"]
    # the volume behind it filled the daemon's cache
    vol = fs.volume
    wait_for(lambda: vol.cached_bytes("fsx/dir/a.bin") == len(data), what="the fill")
    assert vol.wait_fills(10)  # puts' replies are counted once read
    assert fs.stats()["fills_sent"] >= 4
    fs.volume.close()


def test_read_only(local_source, key_file, tmp_path):
    local_source.write("a.bin", b"abc")
    fs = fsspec.filesystem("blockcached", root=local_source.root,
                           **opts(key_file, str(tmp_path / "none.sock")))
    assert fs.cat(f"{local_source.root}/a.bin") == b"abc"
    for call in (lambda: fs.open(f"{local_source.root}/b.bin", "wb"),
                 lambda: fs.rm(f"{local_source.root}/a.bin"),
                 lambda: fs.pipe_file(f"{local_source.root}/a.bin", b"x"),
                 lambda: fs.mkdir(f"{local_source.root}/new")):
        with pytest.raises(PermissionError):
            call()
    with pytest.raises(FileNotFoundError, match="outside the volume root"):
        fs.cat("/etc/hostname")
    with pytest.raises(FileNotFoundError):
        fs.cat(f"{local_source.root}/missing")


@pytest.mark.parametrize("chunk_cache", [True, False])
def test_chunk_cache_option(local_source, key_file, daemon, chunk_cache):
    data = random.Random(2).randbytes(200_000)
    local_source.write("a.bin", data)
    fs = fsspec.filesystem("blockcached", root=local_source.root,
                           **opts(key_file, daemon.socket_path, chunk_cache=chunk_cache))
    path = f"{local_source.root}/a.bin"
    try:
        wait_for(lambda: fs.stats()["daemon_connected"], what="the daemon")
        for _ in range(3):
            assert fs.cat_file(path, 70_000, 74_096) == data[70_000:74_096]
        assert (fs.stats()["chunk_bytes"] > 0) is chunk_cache
    finally:
        fs.volume.close()


def test_latency_chain_counts_requests(local_source):
    data = bytes(range(256)) * 100
    local_source.write("x/y.bin", data)
    fs, root = fsspec.core.url_to_fs(f"latency::file://{local_source.root}",
                                     latency={"delay": 0.001})
    assert isinstance(fs, LatencyFileSystem) and fs.delay == 0.001
    assert fs.cat_file(f"{root}/x/y.bin", start=10, end=20) == data[10:20]
    assert fs.ls(f"{root}/x", detail=False) == [f"{root}/x/y.bin"]
    assert fs.info(f"{root}/x/y.bin")["size"] == len(data)
    assert fs.requests == 3
    with fs.open(f"{root}/x/y.bin") as f:
        assert f.read() == data
    with pytest.raises(PermissionError):
        fs.open(f"{root}/x/z.bin", "wb")
    with pytest.raises(ValueError):
        LatencyFileSystem(target_protocol="file", delay=-1)


def test_blockcached_over_latency_chain(local_source, key_file, daemon):
    data = random.Random(2).randbytes(100_000)
    local_source.write("img/0.jpg", data)
    fs, root = fsspec.core.url_to_fs(f"blockcached::latency::file://{local_source.root}",
                                     blockcached=opts(key_file, daemon.socket_path,
                                                      root=local_source.root),
                                     latency={"delay": 0.001})
    assert fs.cat(f"{root}/img/0.jpg") == data
    s = fs.stats()
    assert s["backend_requests"] - s["version_checks"] == 1  # two 64 KiB blocks, one read
    fs.volume.close()


def test_shares_blocks_with_a_volume_of_the_same_root(s3_server, key_file, daemon):
    from blockcache_client import Volume
    s3 = s3_server.filesystem()
    data = random.Random(3).randbytes(150_000)
    s3.pipe(f"{s3_server.bucket}/shared/x.bin", data)
    with Volume("vol", s3_server.url("shared"), key_file, socket_path=daemon.socket_path,
                block_size=64 << 10, **s3_server.storage_options) as vol:
        assert vol.read("x.bin", 0, len(data)) == data
        assert vol.wait_fills(10)
    daemon.wait_idle()
    fs = fsspec.filesystem("blockcached", target_protocol="s3",
                           target_options=s3_server.storage_options,
                           root=f"{s3_server.bucket}/shared",
                           **opts(key_file, daemon.socket_path, memory_cache_bytes=0))
    assert fs.cat(f"{s3_server.bucket}/shared/x.bin") == data
    s = fs.stats()
    assert s["misses"] == 0 and s["hits"] == 3  # every block came from the shared cache
    fs.volume.close()
