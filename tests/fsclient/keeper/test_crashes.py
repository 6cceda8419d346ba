"""A server killed at the worst moments: in a cold remote fetch, half way
through a directory listing, and under a handle whose remote file changed
meanwhile. The pinned version holds or the read gets ESTALE, never other bytes;
a listing goes on with every entry once."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

import pytest

from tests.support.keepers import kill_server, serving

pytestmark = pytest.mark.fuse

DELAY = 1.0  # each remote request of the slow source


def test_kill_during_a_cold_remote_fetch(tmp_path, tree, daemon, mounts):
    config = tmp_path / "slow.toml"
    config.write_text(f"[storage_options]\nlatency = {{delay = {DELAY}}}\n")
    m = mounts(f"latency::file://{tree}", daemon.socket_path, args=["--config", str(config)])
    want = (tree / "big.bin").read_bytes()
    fd = os.open(os.path.join(m.mountpoint, "big.bin"), os.O_RDONLY)
    got: list = []
    try:
        t = threading.Thread(target=lambda: got.append(os.pread(fd, 8192, 17 * (256 << 10))))
        t.start()
        time.sleep(DELAY / 2)  # the fetch is under way on the server
        old = kill_server(m.mountpoint)
        serving(m.mountpoint, other_than=old)
        t.join(60)
        assert got == [want[17 * (256 << 10):17 * (256 << 10) + 8192]]
    finally:
        os.close(fd)


def test_kill_half_way_through_a_listing(tmp_path, tree, daemon, mounts):
    many = tree / "many"
    many.mkdir()
    names = {f"entry-{i:05d}-{'x' * 60}" for i in range(3000)}
    for n in names:
        (many / n).write_bytes(b"")
    m = mounts(tree, daemon.socket_path)
    seen: list[str] = []
    with os.scandir(os.path.join(m.mountpoint, "many")) as it:
        for i, e in enumerate(it):
            seen.append(e.name)
            if i == 100:  # the rest comes from a server that never saw the opendir
                old = kill_server(m.mountpoint)
                serving(m.mountpoint, other_than=old)
    assert len(seen) == len(names) and set(seen) == names
    assert "took over" in m.log()


def test_a_file_changed_under_a_handle_across_a_kill_is_estale(tmp_path, tree, daemon,
                                                               mounts):
    m = mounts(tree, daemon.socket_path, args=["--meta-ttl", "0"])
    path = tree / "big.bin"
    old_bytes = path.read_bytes()
    fd = os.open(os.path.join(m.mountpoint, "big.bin"), os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == old_bytes[:4096]
        old = kill_server(m.mountpoint)
        serving(m.mountpoint, other_than=old)
        path.write_bytes(bytes(reversed(old_bytes)))  # a new version, same size
        os.utime(path, ns=(time.time_ns() + 10**9,) * 2)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read reaches the server
        off = 3 << 20
        with pytest.raises(OSError) as exc:  # (never the new version's bytes)
            os.pread(fd, 4096, off)
        assert exc.value.errno == errno.ESTALE
    finally:
        os.close(fd)
    # a fresh open sees the new version
    assert (open(os.path.join(m.mountpoint, "big.bin"), "rb").read()
            == bytes(reversed(old_bytes)))


def test_an_unchanged_file_reads_on_across_a_kill(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path, args=["--meta-ttl", "0"])
    want = (tree / "big.bin").read_bytes()
    fd = os.open(os.path.join(m.mountpoint, "big.bin"), os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == want[:4096]
        os.kill(serving(m.mountpoint), signal.SIGKILL)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, 4096, 3 << 20) == want[3 << 20:(3 << 20) + 4096]
    finally:
        os.close(fd)
