"""A fresh mount over a warm shared cache: small files whose cache files are in
the page cache are read at open without waiting on a disk and put in the
kernel's page cache at open, so their reads need no request at all; the
others, and everything while their pages are on disk only, by their first read
request (or inline, when the kernel's readahead wins the race: see below), with
the same bytes and one read request per small file."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from bench.systems import read_into_page_cache
from blockcache_client.common import nowait
from fsclient.mount import KERNEL_READAHEAD_KB
from tests.support.pagecache import drop_tree_pages

pytestmark = pytest.mark.fuse


def _small_files(root) -> dict[str, str]:
    """sha256 of every file under `root` that fits the whole-file read."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path) and 0 < os.path.getsize(path) <= 200 << 10:
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _read(mount, rels) -> dict[str, str]:
    out = {}
    for rel in rels:
        with open(os.path.join(mount.mountpoint, rel), "rb") as f:
            out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.skipif(not nowait.SUPPORTED, reason="needs openat2 and RWF_NOWAIT")
def test_fresh_mount_reads_warm_small_files_inline(tree, daemon, mounts):
    want = _small_files(tree)
    assert len(want) >= 5
    first = mounts(tree, daemon.socket_path, name="first")
    assert _read(first, want) == want
    # every block written before the pages are dropped: the mount's fill thread
    # sends its puts after the reads (under load, after the daemon looks idle),
    # and a block written late would be in the page cache again. The daemon's
    # entry count alone cannot tell: the tree's bigger files' blocks count too.
    # So: the mount has handed every fill to its socket, and then the daemon
    # has written all it got and got no more puts for 0.2 s.
    deadline = time.monotonic() + 20
    while first.stats()["fill_queue_bytes"] and time.monotonic() < deadline:
        time.sleep(0.02)
    seen = [-1, time.monotonic()]  # puts last seen, since when

    def quiet(s) -> bool:
        if s["puts"] != seen[0]:
            seen[:] = [s["puts"], time.monotonic()]
        return (s["queue"]["entries"] == 0 and s["entries"] >= len(want)
                and time.monotonic() - seen[1] >= 0.2)
    daemon.wait_stats(quiet, timeout=20)

    # the cache files' pages are on disk only: read by read requests, same bytes
    assert drop_tree_pages(daemon.cache_dirs) >= len(want)
    second = mounts(tree, daemon.socket_path, name="second")
    assert _read(second, want) == want
    s = second.stats()
    # Hits all, whether inline or by read requests: how many were inline is up
    # to the kernel. A RWF_NOWAIT read of a page not in memory starts its
    # readahead before it answers EAGAIN, and when that I/O completes before
    # the read checks the page (a preempted thread, under load), it returns the
    # bytes: 0 to 10 of 11 such opens were inline, each with only its own
    # cache file's pages back (mincore before and after each file's read).
    assert s["misses"] == 0 and s["hits"] >= len(want), s

    # now in the page cache: a third mount reads them at open without waiting and
    # hands them to the kernel at open: no read requests for those (this
    # machine's kernel may still drop a page meanwhile: such a file takes a read request)
    third = mounts(tree, daemon.socket_path, name="third")
    read_into_page_cache(daemon.cache_dirs)
    assert _read(third, want) == want
    s = third.stats()
    fs = s["fsclient"]
    assert s["misses"] == 0 and fs["inline_loads"] >= len(want) // 2, s
    assert fs["stored_opens"] == fs["inline_loads"], s
    assert fs["ops"].get("read", 0) <= len(want) - fs["stored_opens"], s


def test_one_kernel_read_per_small_file(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    dev = os.stat(m.mountpoint).st_dev
    with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
        assert int(f.read()) == KERNEL_READAHEAD_KB
    path = os.path.join(m.mountpoint, "odd.bin")
    with open(os.path.join(tree, "odd.bin"), "wb") as f:
        f.write(os.urandom(200 << 10))  # more than the kernel's default 128 KiB window
    before = m.stats()["fsclient"]["ops"].get("read", 0)
    with open(path, "rb") as f:
        assert len(f.read()) == 200 << 10
    assert m.stats()["fsclient"]["ops"]["read"] - before == 1


@pytest.mark.skipif(not nowait.SUPPORTED, reason="needs openat2 and RWF_NOWAIT")
def test_a_second_open_while_one_is_open_is_served_by_read_requests(tree, daemon, mounts):
    # zero TTL: every open reads the file anew, and each would be stored, but
    # not while another handle of it is open (the store would wait for the
    # kernel, which may wait for this process to answer that handle's read)
    m = mounts(tree, daemon.socket_path, args=["--dir-ttl", "dir0=0"])
    rel = os.path.join("dir0", "sub1", "file1.bin")  # 100 KiB
    with open(os.path.join(tree, rel), "rb") as f:
        want = f.read()
    path = os.path.join(m.mountpoint, rel)
    with open(path, "rb") as f:  # a miss: fills the cache
        assert f.read() == want
    daemon.wait_idle()
    read_into_page_cache(daemon.cache_dirs)
    s0 = m.stats()["fsclient"]
    with open(path, "rb") as first:
        s1 = m.stats()["fsclient"]
        assert s1["stored_opens"] == s0["stored_opens"] + 1
        with open(path, "rb") as second:
            assert second.read() == want
            s2 = m.stats()["fsclient"]
            assert s2["stored_opens"] == s1["stored_opens"]
            assert s2["ops"]["read"] > s1["ops"].get("read", 0)
        assert first.read() == want
    with open(path, "rb") as again:  # alone again: stored, read without a request
        s3 = m.stats()["fsclient"]
        assert again.read() == want
    s4 = m.stats()["fsclient"]
    assert s3["stored_opens"] == s2["stored_opens"] + 1
    assert s4["ops"]["read"] == s3["ops"]["read"]


@pytest.mark.skipif(not nowait.SUPPORTED, reason="needs openat2 and RWF_NOWAIT")
def test_kept_open_refills_pages_the_kernel_dropped_inline(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    rel = os.path.join("dir0", "sub1", "file1.bin")  # 100 KiB
    with open(os.path.join(tree, rel), "rb") as f:
        want = f.read()
    assert 4096 < len(want) <= 200 << 10
    path = os.path.join(m.mountpoint, rel)
    with open(path, "rb") as f:
        assert f.read() == want
    daemon.wait_idle()
    read_into_page_cache(daemon.cache_dirs)
    s0 = m.stats()["fsclient"]
    with open(path, "rb") as f:  # same version: the kernel keeps and serves its pages
        assert f.read() == want
    s1 = m.stats()["fsclient"]
    assert s1["kept_opens"] == s0["kept_opens"] + 1
    assert s1["ops"].get("read", 0) == s0["ops"].get("read", 0)
    # the kernel loses the file's pages (as under memory pressure): the next
    # kept open's read reaches fsclient, which serves it without waiting on a disk
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        read_into_page_cache(daemon.cache_dirs)
        assert os.pread(fd, len(want) + 1, 0) == want
    finally:
        os.close(fd)
    s2 = m.stats()["fsclient"]
    assert s2["kept_opens"] == s1["kept_opens"] + 1
    assert s2["ops"]["read"] > s1["ops"].get("read", 0)
    assert s2["inline_loads"] == s1["inline_loads"] + 1
