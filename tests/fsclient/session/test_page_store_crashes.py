"""A page-cache store that waits in the kernel never pins a server, and never
lands after the next server's open of a newer version (`fsclient.session.storer`).

The kernel locks a page while a read request of it waits, and a store of that
page waits for the lock. These tests make that wait on purpose: the server is
stopped (SIGSTOP) with a read of a page queued, and a store of the page's
chunk is written through the server's own connection, as its store thread
would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fsclient.session.storer import Storer
from tests.support.fsclient_mounts import REPO, env
from tests.support.keepers import RESUME, copy_fds, serving
from tests.support.pagecache import random_fd

pytestmark = pytest.mark.fuse

CHUNK = 64 << 10
PAGE = 4096

# An earlier server's store: it asks its child to store a chunk and waits
STORE = """
import sys
from fsclient.session.storer import Storer
fuse, saved, nodeid, off = map(int, sys.argv[1:5])
data = open(sys.argv[5], "rb").read()
storer = Storer(fuse, saved)
print(storer.proc.pid, flush=True)
storer.store(nodeid, off, data)
print("stored", flush=True)
"""


def _connection_of(server: int) -> tuple[int, int]:
    """Copies of one of `server`'s /dev/fuse descriptors and of its saved-state memfd."""
    fuse = copy_fds(server, lambda target: target == "/dev/fuse")
    saved = copy_fds(server, lambda target: "fsclient-saved" in target)
    for fd in fuse[1:]:
        os.close(fd)
    return fuse[0], saved[0]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _state(pid: int, tid: int | None = None) -> str:
    """The one-letter scheduler state of a process (or one of its threads)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_server_whose_store_waits_dies_at_once_and_is_replaced(tree, daemon, mounts,
                                                                  tmp_path):
    m = mounts(tree, daemon.socket_path)
    path, want = m.cached("big.bin", daemon)
    nodeid = os.stat(path).st_ino
    server = serving(m.mountpoint)
    fuse, saved = _connection_of(server)
    chunk = 3 * CHUNK
    page = chunk + 5 * PAGE
    (tmp_path / "chunk").write_bytes(want[chunk:chunk + CHUNK])
    fd = random_fd(path)
    pool = ThreadPoolExecutor(1)
    earlier = None
    os.kill(server, signal.SIGSTOP)
    try:
        tids: list[int] = []

        def read_page() -> bytes:
            tids.append(threading.get_native_id())
            return os.pread(fd, PAGE, page)

        reading = pool.submit(read_page)
        # its READ is queued, the page locked until it is answered
        _until(lambda: tids and _state(os.getpid(), tids[0]) == "D", 10,
               "the read never waited for the stopped server")
        earlier = subprocess.Popen(
            [sys.executable, "-c", STORE, str(fuse), str(saved), str(nodeid), str(chunk),
             str(tmp_path / "chunk")], pass_fds=(fuse, saved), stdout=subprocess.PIPE,
            env=env(), cwd=REPO)
        child = int(earlier.stdout.readline())
        _until(lambda: _state(child) == "D", 10, "the store never waited for the read")
        assert earlier.poll() is None and not reading.done()  # the store waits for the read
        # the asker of the store dies at once: the wait is its child's
        earlier.kill()
        earlier.wait(timeout=5)
        assert _alive(child)
        os.kill(server, signal.SIGKILL)
    finally:
        os.kill(server, signal.SIGCONT)
        os.close(fuse)
        os.close(saved)
    try:
        # the keeper starts the next server, which answers the queued read
        assert reading.result(timeout=RESUME) == want[page:page + PAGE]
        # ... so the store ends, and its child (its parent gone) with it
        _until(lambda: not _alive(child), RESUME, "the store's child outlived its store")
        assert os.pread(fd, CHUNK, chunk) == want[chunk:chunk + CHUNK]
    finally:
        os.close(fd)
        pool.shutdown()
        if earlier is not None and earlier.poll() is None:
            earlier.kill()


def test_a_new_server_drops_no_page_before_an_earlier_store_ends(tree, daemon, mounts):
    # a TTL of 0: every open is a new version for the kernel, which drops the
    # inode's pages; a store of the server before must not land after that
    m = mounts(tree, daemon.socket_path, args=["--meta-ttl", "0"])
    path, want = m.cached("big.bin", daemon)
    server = serving(m.mountpoint)
    fuse, saved = _connection_of(server)
    pool = ThreadPoolExecutor(1)
    try:
        earlier = Storer(fuse, saved)  # the child of a server before, its store under way
        try:
            os.kill(server, signal.SIGKILL)
            serving(m.mountpoint, other_than=server)
            opening = pool.submit(lambda: open(path, "rb").read())
            time.sleep(1.0)
            assert not opening.done()  # the new server holds the open back
        finally:
            earlier.close()
        assert opening.result(timeout=RESUME) == want
    finally:
        os.close(fuse)
        os.close(saved)
        pool.shutdown()
