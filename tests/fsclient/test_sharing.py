"""Mounts share the host cache; the daemon can restart under readers; remote
changes become visible per the prefix TTL; readahead follows sequential reads."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from tests.support.trees import snapshot

pytestmark = pytest.mark.fuse


def read_all(root) -> int:
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                n += len(f.read())
    return n


def test_two_mounts_in_two_processes_share_blocks(tree, daemon, mounts):
    a = mounts(tree, daemon.socket_path, name="a")
    b = mounts(tree, daemon.socket_path, name="b")
    total = read_all(a.mountpoint)
    sa = a.stats()
    assert sa["misses"] > 0 and sa["backend_bytes"] >= total
    daemon.wait_idle()
    assert snapshot(b.mountpoint) == snapshot(tree)
    sb = b.stats()
    assert sb["misses"] == 0, sb
    assert sb["backend_bytes"] == 0, sb
    assert sb["hit_bytes"] >= total


def test_daemon_restart_during_reads_fails_no_read(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    want = {rel: v for rel, v in snapshot(tree).items() if v[0] == "f"}
    errors: list[str] = []
    rounds = [0]
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for rel, (_, _size, sha) in want.items():
                try:
                    with open(os.path.join(os.fsencode(m.mountpoint), rel), "rb") as f:
                        data = f.read()
                except OSError as exc:
                    errors.append(f"{rel!r}: {exc}")
                    continue
                if hashlib.sha256(data).hexdigest() != sha:
                    errors.append(f"{rel!r}: wrong bytes")
            rounds[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            time.sleep(0.3)
            daemon.restart()
        daemon.kill()
        time.sleep(0.3)
        daemon.start()
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:5]
    assert rounds[0] >= 2


def _rewrite(path, data: bytes) -> None:
    st = os.stat(path)
    with open(path, "wb") as f:
        f.write(data)
    # a new mtime for certain, so the version changes even within one clock tick
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def test_remote_change_visible_per_prefix_ttl(tmp_path, daemon, mounts):
    src = tmp_path / "remote"
    for d in ("code", "data", "slow"):
        (src / d).mkdir(parents=True)
        (src / d / "f.txt").write_bytes(b"old contents\n")
    m = mounts(src, daemon.socket_path,
               args=["--meta-ttl", "600", "--dir-ttl", "data/=1", "--dir-ttl", "code/=0"])
    mp = m.mountpoint

    def read(d):
        with open(os.path.join(mp, d, "f.txt"), "rb") as f:
            return f.read()

    for d in ("code", "data", "slow"):
        assert read(d) == b"old contents\n"
        os.listdir(os.path.join(mp, d))
    for d in ("code", "data", "slow"):
        _rewrite(src / d / "f.txt", b"new, longer contents\n")

    # zero TTL: the very next access sees the change (size and bytes)
    assert os.path.getsize(os.path.join(mp, "code", "f.txt")) == 21
    assert read("code") == b"new, longer contents\n"
    # long TTL: still the cached view (this is what the TTL buys)
    assert os.path.getsize(os.path.join(mp, "slow", "f.txt")) == 13
    # 1 s TTL: visible once the TTL has passed
    deadline = time.monotonic() + 15
    while read("data") != b"new, longer contents\n":
        assert time.monotonic() < deadline, "change under data/ (TTL 1s) never became visible"
        time.sleep(0.2)
    assert os.path.getsize(os.path.join(mp, "data", "f.txt")) == 21

    # a file created remotely appears under code/ at once (no negative caching there)
    assert not os.path.exists(os.path.join(mp, "code", "new.py"))
    (src / "code" / "new.py").write_text("x = 1\n")
    assert os.path.exists(os.path.join(mp, "code", "new.py"))


def test_readahead_follows_sequential_reads_only(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    path = os.path.join(m.mountpoint, "big.bin")
    fd = os.open(path, os.O_RDONLY)
    try:
        # random 4 KiB reads, far apart, kernel readahead off: no prefetch
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off in (4 << 20, 1 << 20, 3 << 20, 0, 2 << 20):
            assert len(os.pread(fd, 4096, off)) == 4096
    finally:
        os.close(fd)
    assert m.stats()["fsclient"]["prefetches"] == 0
    with open(os.path.join(m.mountpoint, "dir0", "sub1", "file1.bin"), "rb") as f:
        f.read()  # small files never read ahead either
    assert m.stats()["fsclient"]["prefetches"] == 0
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).digest() == hashlib.sha256(
            (tree / "big.bin").read_bytes()).digest()
    st = m.stats()
    assert st["fsclient"]["prefetches"] > 0
    assert st["prefetches"] > 0  # the volume fetched blocks ahead of the reader
