"""What the daemon and the readers trust on disk and on the socket.

Someone who can write in the cache tree (a misconfigured mode, a
compromised daemon uid) plants symlinks and FIFOs; someone who takes the
socket path answers as the daemon. Neither may make the daemon delete or
write outside its tree, a reader open anything but a block file of the
daemon's, or a mount hang; a dir the daemon cannot trust is refused at start.
"""

from __future__ import annotations

import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from blockcache_client.contract import blockfile, protocol
from blockcache_client.contract.errors import DaemonUnavailable
from blockcache_client.contract.layout import Layout, fanout
from blockcache_client.daemonclient.client import Client
from devtools.daemon import DaemonProcess
from tests.support.cache_engine import key as make_key
from tests.support.figures import record
from tests.support.fsclient_mounts import FsclientMount
from tests.support.remote_files import write_dataset
from tests.support.skips import needs_fuse, needs_root
from tests.support.volumes import BS, block_key, connected_volume, fill_files
from tests.support.waiting import wait_for

pytestmark = needs_root


def _key_in_new_fanout(cache: str, vol: str = "v") -> str:
    """A block key whose fan-out top dir does not exist in `cache` yet."""
    for inode in range(1, 10_000):
        k = make_key(vol, inode=inode)
        if not os.path.exists(os.path.join(cache, "blocks", fanout(k)[:2])):
            return k
    raise AssertionError("every fan-out dir exists")


def _victim(tmp_path, name: str, files: int = 3) -> dict[str, bytes]:
    """A dir outside the cache with files in it; {path: bytes}."""
    d = tmp_path / name
    d.mkdir()
    out = {}
    for i in range(files):
        p = d / f"precious-{i}"
        p.write_bytes(os.urandom(100))
        out[str(p)] = p.read_bytes()
    return out


def _unchanged(files: dict[str, bytes]) -> bool:
    return all(os.path.exists(p) and open(p, "rb").read() == b for p, b in files.items())


def test_symlinked_tmp_and_fanout_dirs_never_take_the_daemon_outside(tmp_path):
    cache = str(tmp_path / "cache")
    os.makedirs(os.path.join(cache, "blocks"))
    victim = _victim(tmp_path, "victim")
    os.symlink(tmp_path / "victim", os.path.join(cache, "tmp"))
    d = DaemonProcess(tmp_path, cache_dirs=[(cache, "64M")])
    d.start()
    try:
        # start-up cleanup emptied the real tmp/, not the link's target
        assert _unchanged(victim)
        assert os.path.isdir(os.path.join(cache, "tmp"))
        assert not os.path.islink(os.path.join(cache, "tmp"))

        # a fan-out top dir replaced by a link: the put lands inside the cache
        k = _key_in_new_fanout(cache)
        outside = tmp_path / "outside"
        outside.mkdir()
        top = os.path.join(cache, "blocks", fanout(k)[:2])
        os.symlink(outside, top)
        vk = os.urandom(32)
        c = d.client()
        assert c.put(k, blockfile.seal(k, b"x" * 1000, vk)) == (True, "queued")
        d.wait_idle()
        assert list(outside.iterdir()) == []
        assert not os.path.islink(top)
        [path] = c.lookup([k])
        assert path == os.path.join(cache, "blocks", fanout(k), k) and os.path.isfile(path)

        # links planted while the daemon is down are removed by the scan, and
        # what they point at is neither indexed nor touched
        d.stop()
        k2 = _key_in_new_fanout(cache)
        out2 = tmp_path / "outside2"
        (out2 / fanout(k2)[3:]).mkdir(parents=True)
        planted = out2 / fanout(k2)[3:] / k2
        planted.write_bytes(blockfile.seal(k2, b"y" * 1000, vk))
        top2 = os.path.join(cache, "blocks", fanout(k2)[:2])
        os.symlink(out2, top2)
        mid = os.path.join(cache, "blocks", fanout(k)[:2], "zz")
        os.symlink(outside, mid)
        d.start()
        s = d.wait_rebuilt()
        assert not os.path.lexists(top2) and not os.path.lexists(mid)
        assert planted.exists() and d.client().lookup([k2]) == [None]
        assert s["entries"] == 1 and s["rebuild"]["removed"] >= 2
        record("symlinked_tree", tmp_link_target_files_kept=len(victim),
               put_through_linked_fanout="inside the cache", links_removed_by_scan=2)
    finally:
        d.stop()


def test_symlinked_lock_file_is_refused(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    victim = _victim(tmp_path, "victim", files=1)
    [target] = victim
    os.symlink(target, cache / "blockcached.lock")
    d = DaemonProcess(tmp_path, cache_dirs=[(cache, "64M")])
    try:
        with pytest.raises(RuntimeError, match="lock file .* is a symlink; remove it"):
            d.start()
    finally:
        d.stop()
    assert _unchanged(victim)  # not truncated, no pid written into it


def _start_fails(tmp_path, cache: str, socket_dir: str) -> tuple[int, str]:
    argv = [sys.executable, "-m", "blockcached", "--socket", os.path.join(socket_dir, "s.sock"),
            "--cache-dir", f"{cache}:64M", "--min-free-bytes", "0"]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=20,
                             cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": os.getcwd()})
    except subprocess.TimeoutExpired:
        pytest.fail("blockcached started on a dir it must refuse")
    return res.returncode, res.stderr


@pytest.mark.parametrize("which", ["cache", "socket"])
def test_dirs_others_can_write_or_the_daemon_does_not_own_are_refused(tmp_path, which):
    cache, sock = tmp_path / "cache", tmp_path / "run"
    cache.mkdir()
    sock.mkdir()
    bad = cache if which == "cache" else sock
    for mode in (0o775, 0o757, 0o1777):
        os.chmod(bad, mode)
        code, err = _start_fails(tmp_path, str(cache), str(sock))
        assert code == 2 and f"chmod go-w {bad}" in err, err
    os.chmod(bad, 0o755)
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(bad, nobody, -1)
    code, err = _start_fails(tmp_path, str(cache), str(sock))
    assert code == 2 and f"owned by uid {nobody}" in err and f"chown 0 {bad}" in err, err
    assert "Traceback" not in err
    record(f"untrusted_{which}_dir", modes_refused=["0775", "0757", "1777"],
           foreign_owner_refused=True, exit_status=2)


def _replace_with_fifo(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path, 0o644)


@needs_fuse
def test_fifo_in_the_tree_never_hangs_a_mount(tmp_path, key_file):
    src = tmp_path / "src"
    files = write_dataset(str(src), [BS // 2] * 4, seed=7)
    d = DaemonProcess(tmp_path).start()
    m = FsclientMount(str(src), str(tmp_path / "mnt"), key_file, d.socket_path, volume="vol",
                      args=["--block-size", str(BS)], log_path=str(tmp_path / "mnt.log"))
    try:
        m.start()
        rels = sorted(files)
        for rel in rels:  # warm: every block cached, and in the page cache
            assert (tmp_path / "mnt" / rel).read_bytes() == files[rel]
        wait_for(lambda: d.client().stats()["entries"] == len(files), what="the fills")
        d.wait_idle()
        m.stop()
        layout = Layout.from_wire(d.client().hello()["layout"])
        with connected_volume("vol", str(src), key_file, d, block_size=BS) as vol:
            fifo = layout.path(block_key(vol, rels[0]))
        _replace_with_fifo(fifo)
        # a fresh mount: its first open of the file tries the event loop's
        # no-wait path, where a blocking open(2) would freeze every request
        m.start()
        got: dict[str, bytes] = {}

        def read_all() -> None:
            for rel in rels:
                got[rel] = (tmp_path / "mnt" / rel).read_bytes()

        t = threading.Thread(target=read_all, daemon=True)
        start = time.monotonic()
        t.start()
        t.join(15)
        took = time.monotonic() - start
        if t.is_alive():  # unblock the mount's open(2) so teardown can finish
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail("reads through the mount hung on a FIFO in the cache tree")
        assert got == files
        assert os.listdir(tmp_path / "mnt")  # the mount still answers
        s = m.stats()
        assert s["integrity_failures"] == 1 and s["hits"] >= len(files) - 1
        wait_for(lambda: os.path.isfile(fifo), what="the FIFO replaced by a refilled block")
        record("fifo_in_tree", files_read=len(files), seconds=round(took, 2),
               counted_as_bad=s["integrity_failures"], refilled=True)
    finally:
        m.stop()
        d.stop()


def test_reader_opens_only_regular_files_of_the_daemons_uid(tmp_path, key_file):
    src = tmp_path / "src"
    files = write_dataset(str(src), [BS // 2] * 3, seed=8)
    rels = sorted(files)
    d = DaemonProcess(tmp_path).start()
    try:
        with connected_volume("vol", str(src), key_file, d) as vol:
            layout = fill_files(vol, d, files)
            paths = [layout.path(block_key(vol, rel)) for rel in rels]
            # a symlink to a FIFO outside the tree: following it would block
            outside = tmp_path / "fifo"
            os.mkfifo(outside)
            os.unlink(paths[0])
            os.symlink(outside, paths[0])
            # an authentic block, but owned by someone else than the daemon
            os.chown(paths[1], pwd.getpwnam("nobody").pw_uid, -1)
            # block_map (warmup --check) counts neither as cached
            assert [vol.block_map(r)[0][2] for r in rels] == [False, False, True]
            before = vol.stats()
            t = threading.Thread(target=lambda: [vol.read(r, 0, BS) for r in rels], daemon=True)
            t.start()
            t.join(15)
            if t.is_alive():
                os.close(os.open(outside, os.O_WRONLY | os.O_NONBLOCK))
                pytest.fail("a reader followed a symlink in the cache tree to a FIFO")
            s = vol.stats()
            assert s["hits"] - before["hits"] == 1  # only the untouched block
            assert s["integrity_failures"] - before["integrity_failures"] == 2
            for rel in rels:
                assert vol.read(rel, 0, BS) == files[rel]
        record("reader_trusts_only_daemon_files", symlink_refused=True,
               foreign_owner_refused=True, hits_served_from_them=0)
    finally:
        d.stop()


def _fake_daemon(path: str, uid: int, ready) -> None:
    """Answer hello/ping/touch on `path` as uid `uid`, with a layout of its own."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(16)
    os.write(ready, b"x")
    while True:
        conn, _ = srv.accept()
        try:
            while True:
                head = conn.recv(4)
                if len(head) < 4:
                    break
                body = b""
                n = protocol.frame_length(head)
                while len(body) < n:
                    body += conn.recv(n - len(body))
                req = protocol.decode_body(body)
                reply = {"id": req["id"], "ok": True, "version": protocol.PROTOCOL_VERSION,
                         "layout_epoch": 1,
                         "layout": {"dirs": [{"path": "/etc", "weight": 1, "healthy": True}]},
                         "max_frame": protocol.MAX_FRAME, "max_batch": 16, "uid": uid,
                         "time": 0.0, "touched": 0, "accepted": True, "reason": "queued"}
                conn.sendall(protocol.encode_frame(reply))
        except OSError:
            pass
        finally:
            conn.close()


def test_socket_answered_by_an_unexpected_uid_is_no_daemon(tmp_path, shared_dir, key_file,
                                                          caplog):
    run = Path(shared_dir) / "run"
    run.mkdir()
    os.chmod(run, 0o1777)  # like /tmp: anyone may create a socket here (root owns it)
    nobody = pwd.getpwnam("nobody").pw_uid
    path = str(run / "blockcached.sock")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _fake_daemon(path, nobody, w)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x"
        with pytest.raises(DaemonUnavailable, match=f"runs as uid {nobody}.*"
                                                    f"BLOCKCACHE_DAEMON_UID={nobody}"):
            Client(path, timeout=2).ping()
        src = tmp_path / "src"
        files = write_dataset(str(src), [1000], seed=9)
        from blockcache_client import Volume
        with Volume("vol", str(src), key_file, socket_path=path, block_size=BS) as vol:
            wait_for(lambda: any("runs as uid" in r.getMessage() for r in caplog.records
                                 if r.levelname == "WARNING"), what="a warning naming the uid")
            assert not vol.stats()["daemon_connected"]
            [(rel, data)] = files.items()
            assert vol.read(rel, 0, len(data)) == data
            assert vol.stats()["misses"] == 1
        # the uid a user names is accepted
        with Client(path, timeout=2, daemon_uid=nobody) as c:
            assert c.ping()["ok"]
        record("unexpected_peer_uid", peer_uid="nobody", expected="root or the socket dir's "
               "owner (root)", treated_as="no daemon", with_daemon_uid="accepted")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
