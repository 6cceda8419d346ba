"""A real blockcached process: the protocol end to end, restarts, crashes, abuse."""

from __future__ import annotations

import json
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

from blockcache_client import cli
from blockcache_client.contract import blockfile, layout, protocol, wire
from blockcache_client.contract.errors import BlockcacheError, DaemonError, DaemonUnavailable
from blockcache_client.contract.protocol import ErrorCode
from blockcache_client.daemonclient.client import Client
from blockcached.buffers import FRAME_CLASS
from blockcached.server import BUDGETED_TIMEOUT, READ_SIZE, SMALL_FRAME
from devtools.daemon import DaemonProcess
from tests.support.blocks import VOLUME_KEY, make_block, make_key
from tests.support.pipeline import pipeline


def test_put_lookup_touch_stats(daemon):
    c = daemon.client()
    hello = c.hello()
    assert hello["version"] == protocol.PROTOCOL_VERSION
    key = make_key()
    blob = make_block(key)
    assert c.put(key, blob) == (True, "queued")
    daemon.wait_idle()
    [path] = c.lookup([key])
    assert path == os.path.join(daemon.cache_dirs[0], layout.block_relpath(key))
    with open(path, "rb") as f:
        assert blockfile.unseal(key, f.read(), VOLUME_KEY) is not None
    assert c.lookup([make_key(offset=4096)]) == [None]
    assert c.touch([key])["touched"] == 1
    assert c.put(key, blob) == (False, "exists")
    s = c.stats()
    assert s["entries"] == 1 and s["hits"] == 1 and s["misses"] == 1
    assert s["used_bytes"] == len(blob)
    # the reader-side view per volume: one touch (a hit), two puts (fills after misses)
    assert s["volumes"] == {"vol": {"entries": 1, "used_bytes": len(blob), "touches": 1,
                                    "touch_bytes": len(blob), "puts": 2,
                                    "put_bytes": 2 * len(blob), "quota_bytes": 0}}
    assert os.stat(path).st_mode & 0o777 == 0o644


def test_evict_scopes_and_list(daemon):
    c = daemon.client()
    keys = [make_key(vol, ino, off) for vol in ("a", "b") for ino in (1, 2) for off in (0, 4096)]
    for k in keys:
        assert c.put(k, make_block(k, 100))[0]
    daemon.wait_idle()
    assert c.list()["keys"] == sorted(keys)
    page = c.list("a", limit=2)
    assert (page["keys"], page["truncated"]) == (sorted(keys)[:2], True)
    assert c.evict(keys[0]) == 1
    assert c.evict(inode=("a", 2)) == 2
    assert c.evict(volume="a") == 1
    assert c.list("a")["keys"] == []
    paths = c.lookup(keys[4:])
    assert all(p and os.path.exists(p) for p in paths)
    assert c.evict(all_=True) == 4
    assert c.stats()["entries"] == 0
    daemon.wait_stats(lambda s: all(d["queued_jobs"] == 0 for d in s["dirs"]))
    assert not any(os.path.exists(p) for p in paths)


def test_bad_requests_get_errors_and_connection_survives(daemon):
    c = daemon.client()
    for bad in ("../../etc/passwd", "vol_1_000000000000000000000000000000ab_0000000000000000/x",
                "vol_01_00000000000000000000000000000000_0000000000000000",
                "Vol_1_00000000000000000000000000000000_0000000000000000"):
        with pytest.raises(DaemonError) as err:
            c.lookup([bad])
        assert err.value.code == ErrorCode.INVALID_KEY
    key = make_key()
    blob = make_block(key)
    for data in (blob[:-1], b"junk" * 20, blob[:40]):
        with pytest.raises(DaemonError) as err:
            c.put(key, data)
        assert err.value.code == ErrorCode.INVALID_BLOCK
    replies = pipeline(c, [("nosuch", {}), ("lookup", {"keys": "notalist"}),
                           ("evict", {}), ("hello", {"version": 99}), ("ping", {})])
    assert [r.get("code") for r in replies] == [ErrorCode.UNKNOWN_OP, ErrorCode.BAD_REQUEST,
                                                ErrorCode.BAD_REQUEST,
                                                ErrorCode.UNSUPPORTED_VERSION, None]
    assert not list(Path(daemon.cache_dirs[0]).rglob("passwd"))
    errors = c.stats()["errors"]
    assert errors[ErrorCode.INVALID_KEY] == 4 and errors[ErrorCode.INVALID_BLOCK] == 3


def _raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def _read_reply(s: socket.socket) -> dict | None:
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    n = protocol.frame_length(head)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return protocol.decode_body(body)


@pytest.mark.parametrize("garbage", [
    b"\x00\x00\x00\x05hello",                  # not msgpack
    b"\x00\x00\x00\x01\x93",                   # msgpack array, not a map, truncated
    b"\x00\x00\x00\x00",                       # zero length
    b"\xff\xff\xff\xff" + b"x" * 100,          # over MAX_FRAME
    protocol.LENGTH.pack(3) + b"\x81\xa1a",     # a map without a request id
])
def test_garbage_on_the_socket(daemon, garbage):
    good = daemon.client()
    assert good.ping()["ok"]
    s = _raw(daemon.socket_path)
    try:
        s.sendall(garbage)
        reply = _read_reply(s)
        assert reply is not None and reply["ok"] is False and reply["id"] == 0
        assert _read_reply(s) is None  # closed after a frame it cannot trust
    finally:
        s.close()
    assert good.ping()["ok"]  # others unaffected, the daemon is alive
    assert daemon.proc.poll() is None


def test_stalled_and_half_frames_do_not_block_others(daemon):
    stalled = _raw(daemon.socket_path)
    half = _raw(daemon.socket_path)
    try:
        stalled.sendall(protocol.LENGTH.pack(1000) + b"\x82")  # body never completes
        half.sendall(b"\x00\x00")
        half.close()  # hangs up mid-prefix
        c = daemon.client()
        key = make_key()
        assert c.put(key, make_block(key))[0]
        daemon.wait_idle()
        assert c.lookup([key])[0] is not None
    finally:
        stalled.close()


def test_restart_brings_entries_back_and_clears_tmp(daemon):
    c = daemon.client()
    keys = [make_key(inode=i + 1) for i in range(50)]
    for k in keys:
        c.put(k, make_block(k, 1000))
    daemon.wait_idle()
    before = c.lookup(keys)
    tmp_leftover = Path(daemon.cache_dirs[0]) / "tmp" / "99999.1"
    daemon.stop()
    tmp_leftover.write_bytes(b"half a block")
    daemon.start()
    s = daemon.wait_rebuilt()
    c = daemon.client()
    assert s["entries"] == 50 and s["rebuild"]["scanned"] == 50
    assert c.lookup(keys) == before
    assert not tmp_leftover.exists()
    assert s["rebuild"]["removed"] == 1


def test_kill_during_puts_leaves_no_partial_block(daemon):
    """kill -9 while blocks are being written; after restart every indexed
    block is complete and authentic, and tmp/ is empty."""
    stop = threading.Event()
    sent = []

    def writer():
        c = Client(daemon.socket_path, timeout=2)
        i = 0
        while not stop.is_set():
            k = make_key(inode=i + 1)
            try:
                c.put(k, make_block(k, 1 << 20))
                sent.append(k)
            except BlockcacheError:
                return
            i += 1
        c.close()

    t = threading.Thread(target=writer)
    t.start()
    try:
        daemon.wait_stats(lambda s: s["writes"] >= 5, timeout=30)
    finally:
        daemon.kill()
        stop.set()
        t.join(10)
    daemon.start()
    daemon.wait_rebuilt()
    c = daemon.client()
    listed = c.list_all()
    assert listed, "some writes completed before the kill"
    for k, path in zip(listed, c.lookup(listed)):
        with open(path, "rb") as f:
            blockfile.unseal(k, f.read(), VOLUME_KEY, 0, 16)
    assert list((Path(daemon.cache_dirs[0]) / "tmp").iterdir()) == []


def _run_second(tmp_path, **kw) -> subprocess.CompletedProcess:
    second = DaemonProcess(tmp_path / "second", **kw)
    return subprocess.run(second.argv(), capture_output=True, text=True, timeout=20,
                          cwd=str(Path(__file__).resolve().parents[2]))


def test_second_daemon_on_same_dir_or_socket_is_refused(daemon, tmp_path):
    same_dir = _run_second(tmp_path, cache_dirs=[(daemon.cache_dirs[0], "1G")])
    assert same_dir.returncode != 0
    assert "blockcached.lock" in same_dir.stderr and "in use" in same_dir.stderr
    other = DaemonProcess(tmp_path / "third")
    other.socket_path = daemon.socket_path
    r = subprocess.run(other.argv(), capture_output=True, text=True, timeout=20)
    assert r.returncode != 0
    assert daemon.socket_path + ".lock" in r.stderr
    assert daemon.client().ping()["ok"]  # the first one is untouched


def test_sigterm_drains_and_exits_zero(daemon):
    c = daemon.client()
    keys = [make_key(inode=i + 1) for i in range(20)]
    for k in keys:
        c.put(k, make_block(k, 64 << 10))
    assert daemon.stop() == 0
    assert not os.path.exists(daemon.socket_path)
    daemon.start()
    assert daemon.wait_rebuilt()["entries"] == 20  # the queue was written before exit


def _become_nobody() -> None:
    """In a forked child: drop to uid and gid nobody, no other groups."""
    nobody = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)


def _as_nobody(args: list[str]) -> subprocess.CompletedProcess:
    """Run `blockcache-cli args` in a forked child that dropped to uid/gid nobody.

    Forked rather than exec'd: the venv's interpreter lives under /root,
    which nobody cannot execute."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 99
        try:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            _become_nobody()
            try:
                cli.main(args, prog_name="blockcache-cli")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    with open(out_r, "rb") as f:
        out = f.read().decode()
    with open(err_r, "rb") as f:
        err = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(status), out, err)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to uid nobody")
@pytest.mark.parametrize("admin", [False, True])
def test_admin_evictions_need_admin_peer(tmp_path, shared_dir, admin):
    nogroup = pwd.getpwnam("nobody").pw_gid
    extra = ["--socket-group", str(nogroup)] + (["--admin-gid", str(nogroup)] if admin else [])
    d = DaemonProcess(tmp_path, extra_args=extra)
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    with d:
        st = os.stat(d.socket_path)
        assert st.st_mode & 0o777 == 0o660 and st.st_gid == nogroup
        c = d.client()
        keys = [make_key("v", 1), make_key("v", 2), make_key("w", 1)]
        for k in keys:
            c.put(k, make_block(k, 100))
        d.wait_idle()
        cli_args = ["--socket", d.socket_path]
        env_ok = _as_nobody(cli_args + ["ping"])
        assert env_ok.returncode == 0, env_ok.stderr
        r = _as_nobody(cli_args + ["evict", "--key", keys[0]])  # anyone who may connect
        assert r.returncode == 0 and "evicted 1 block" in r.stdout, r.stderr
        vol = _as_nobody(cli_args + ["evict", "--volume", "v"])
        every = _as_nobody(cli_args + ["evict", "--all"])
        if admin:
            assert vol.returncode == 0 and every.returncode == 0
            assert c.stats()["entries"] == 0
        else:
            for r in (vol, every):
                assert r.returncode == 1
                assert "permission_denied" in r.stderr and "Traceback" not in r.stderr
                assert len(r.stderr.strip().splitlines()) == 1
            assert c.stats()["entries"] == 2
            assert c.evict(volume="v") == 1  # root is always admin


def test_cli(daemon):
    argv = [sys.executable, "-m", "blockcache_client.cli", "--socket", daemon.socket_path]

    def run(*args):
        return subprocess.run(argv + list(args), capture_output=True, text=True, timeout=20)

    c = daemon.client()
    keys = [make_key("cli", i + 1) for i in range(3)]
    for k in keys:
        c.put(k, make_block(k, 100))
    daemon.wait_idle()
    r = run("ping")
    assert r.returncode == 0 and r.stdout.startswith("ok")
    r = run("stats")
    assert r.returncode == 0 and "entries      3" in r.stdout and daemon.cache_dirs[0] in r.stdout
    r = run("stats", "--json")
    s = json.loads(r.stdout)
    assert s["entries"] == 3 and "id" not in s and "ok" not in s
    assert set(s) >= {"entries", "used_bytes", "capacity_bytes", "hits", "misses", "puts",
                      "put_bytes", "drops", "evictions", "rebuild", "dirs", "volumes",
                      "connections", "errors"}
    r = run("ls", "--volume", "cli", "--limit", "2")
    assert r.stdout.split() == sorted(keys)[:2] and "raise --limit" in r.stderr
    assert run("evict", "--inode", "cli", "1").stdout.strip() == "evicted 1 block"
    r = run("evict", "--key", "../etc")
    assert r.returncode == 1 and "invalid_key" in r.stderr and "Traceback" not in r.stderr
    r = run("evict")
    assert r.returncode == 2
    assert run("evict", "--all").stdout.strip() == "evicted 2 blocks"
    daemon.stop()
    r = run("stats")
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1
    assert "cannot connect" in r.stderr and "Traceback" not in r.stderr


def test_systemd_notifications(tmp_path):
    """READY=1 once serving, WATCHDOG=1 at half of WATCHDOG_USEC, STOPPING=1 on
    SIGTERM, over an abstract '@' notify socket."""
    name = f"bc-notify-{os.getpid()}-{id(tmp_path)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind("\0" + name)
    listener.settimeout(10)
    d = DaemonProcess(tmp_path)
    env = dict(os.environ, NOTIFY_SOCKET="@" + name, WATCHDOG_USEC="200000",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(d.argv(), env=env, stderr=subprocess.DEVNULL)
    try:
        messages = []
        while not any(m.startswith("READY=1") for m in messages):
            messages.append(listener.recv(4096).decode())
        assert Client(d.socket_path).ping()["ok"]  # READY means serving
        watchdogs = 0
        while watchdogs < 3:
            watchdogs += listener.recv(4096) == b"WATCHDOG=1"
        proc.terminate()
        while listener.recv(4096) != b"STOPPING=1":
            pass
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()


def test_big_stalled_frames_hold_only_the_read_budget(daemon):
    """More half-sent maximal frames than the read budget holds: small requests
    are still answered, and once the stalled clients go, big puts flow again."""
    stalled = []
    try:
        for _ in range(10):  # 10 x 17 MiB > the 128 MiB read budget
            s = _raw(daemon.socket_path)
            s.sendall(protocol.LENGTH.pack(protocol.MAX_FRAME) + b"\x82" + b"\0" * 1000)
            stalled.append(s)
        c = daemon.client()
        key = make_key()
        assert c.lookup([key]) == [None]
        assert c.ping()["ok"]
    finally:
        for s in stalled:
            s.close()
    big = make_key(inode=2)
    assert c.put(big, make_block(big, 1 << 20)) == (True, "queued")
    daemon.wait_idle()
    assert c.lookup([big])[0] is not None
    assert c.stats()["errors"][ErrorCode.BAD_FRAME] == 10


def test_stalled_peers_cannot_keep_fills_out(daemon):
    """Peers that take the whole read budget with half-sent frames and stall
    are cut off after the short budgeted deadline, not the 30 s frame
    deadline, so a real reader's put gets through within its own timeout."""
    stalled = []
    try:
        for _ in range(8):  # 8 x 17 MiB: the whole 128 MiB budget
            s = _raw(daemon.socket_path)
            s.sendall(protocol.LENGTH.pack(protocol.MAX_FRAME) + b"\x82")
            stalled.append(s)
        time.sleep(0.2)  # let the daemon grant them the budget first
        c = Client(daemon.socket_path, timeout=15.0)
        big = make_key(inode=3)
        assert c.put(big, make_block(big, 1 << 20)) == (True, "queued")
        # each is closed by the daemon (a recv timeout fails); the last one
        # queued behind the put for budget, so it may take two budgeted deadlines
        for s in stalled:
            s.settimeout(3 * BUDGETED_TIMEOUT)
            while s.recv(1 << 16):
                pass
    finally:
        for s in stalled:
            s.close()


def _connect_as_nobody(path: str, count: int) -> list[socket.socket]:
    """`count` connections to `path` whose peer is uid nobody: made by a forked
    child that dropped to it, and handed back over a socket pair."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            ours.close()
            _become_nobody()
            conns = [_raw(path) for _ in range(count)]
            socket.send_fds(theirs, [b"x"], [c.fileno() for c in conns])
            code = 0
        except BaseException as exc:  # (shown in pytest's captured stderr)
            os.write(2, f"connecting as nobody: {exc!r}\n".encode())
        finally:
            os._exit(code)
    theirs.close()
    try:
        _, fds, _, _ = socket.recv_fds(ours, 1, count)
    finally:
        ours.close()
        os.waitpid(pid, 0)
    assert len(fds) == count
    return [socket.socket(fileno=fd) for fd in fds]


def _closed_by_peer(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1 << 16) == b""
    except BlockingIOError:
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to uid nobody")
def test_a_stalled_uid_holds_only_its_share_of_the_read_budget(tmp_path, shared_dir):
    """One non-admin uid's half-sent large frames hold at most its share of
    the read budget (one 17 MiB frame of the 32 MiB share); the rest wait for
    it, so an admin's put goes through while every one of them stalls, not
    after the budgeted deadline has cut them off."""
    nogroup = pwd.getpwnam("nobody").pw_gid
    d = DaemonProcess(tmp_path, extra_args=["--socket-group", str(nogroup)])
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    with d:
        stalled = _connect_as_nobody(d.socket_path, 8)
        try:
            for s in stalled:  # 8 x 17 MiB: the whole 128 MiB budget, were it theirs
                s.sendall(protocol.LENGTH.pack(protocol.MAX_FRAME) + b"\x82")
            d.wait_stats(lambda s: s["refused"].get("read_budget", 0) >= 7)
            c = Client(d.socket_path, timeout=15.0)  # root: an admin
            big = make_key(inode=3)
            assert c.put(big, make_block(big, 1 << 20)) == (True, "queued")
            # the 7 frames waiting for budget have their 30 s frame deadline, not
            # the 5 s one: without the share they would have held the budget,
            # and been cut off before the put could go
            assert sum(not _closed_by_peer(s) for s in stalled) >= 7
        finally:
            for s in stalled:
                s.close()


def test_failing_dir_is_taken_out_then_returned(daemon):
    c = daemon.client()
    key = make_key()
    c.put(key, make_block(key))
    daemon.wait_idle()
    epoch = c.ping()["layout_epoch"]
    blocks = Path(daemon.cache_dirs[0]) / "blocks"
    away = blocks.with_name("blocks.away")
    blocks.rename(away)
    # a file where the dir was: the daemon, writing through its descriptor of
    # the old dir, notices the swap (readers would never find those blocks)
    blocks.write_bytes(b"")
    try:
        for i in range(3):
            k = make_key(inode=10 + i)
            c.put(k, make_block(k))
            daemon.wait_stats(lambda s: s["queue"]["entries"] == 0)
        s = daemon.wait_stats(lambda s: not s["dirs"][0]["healthy"])
        assert "moved behind the daemon" in s["dirs"][0]["unhealthy_reason"]
        hello = c.hello()
        assert hello["layout"]["dirs"][0]["healthy"] is False and hello["layout_epoch"] > epoch
        assert c.lookup([key]) == [None]
        k = make_key(inode=99)
        assert c.put(k, make_block(k)) == (False, "unhealthy")
    finally:
        blocks.unlink()
        away.rename(blocks)
    daemon.wait_stats(lambda s: s["dirs"][0]["healthy"] and s["rebuild"]["state"] == "done",
                      timeout=20)
    assert c.lookup([key])[0] is not None


def test_client_that_never_reads_replies_stalls_only_itself(daemon):
    per_frame = 2900
    c = daemon.client()
    key = make_key()
    c.put(key, make_block(key))
    daemon.wait_idle()
    # each reply carries 2900 paths (~0.4 MB): a few fill every buffer on the
    # way; the request is ~170 KB, so several fit in the ~0.9 MB buffered
    frame = protocol.encode_frame({"id": 1, "op": "lookup", "keys": [key] * per_frame})
    hog = _raw(daemon.socket_path)
    hog.setblocking(False)
    sent = 0
    rest = memoryview(frame)
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # pipeline requests and never read
            try:
                n = hog.send(rest)
            except BlockingIOError:
                time.sleep(0.01)
                continue
            sent += n
            # a partial send is continued, never restarted: the stream stays
            # well-framed, so the daemon has no reason to close it
            rest = rest[n:] or memoryview(frame)
        hits = c.stats()["hits"]
        for _ in range(20):
            assert c.ping()["ok"]
        assert c.lookup([key])[0] is not None
        c.close()
    finally:
        hog.close()
    assert sent > 4 * len(frame)
    assert hits < sent // len(frame) * per_frame  # the daemon stopped reading the hog
    # only wait_stats' own connection is left: the hog's was noticed closed
    daemon.wait_stats(lambda s: s["connections"] == 1)


def test_client_that_half_closes_still_gets_its_replies(daemon):
    frames = b"".join(protocol.encode_frame({"id": i + 1, "op": "ping"}) for i in range(100))
    s = _raw(daemon.socket_path)
    try:
        s.sendall(frames)
        s.shutdown(socket.SHUT_WR)
        ids = []
        while (reply := _read_reply(s)) is not None:
            ids.append(reply["id"])
        assert ids == list(range(1, 101))  # all answered, in order, then closed
    finally:
        s.close()
    daemon.wait_stats(lambda st: st["connections"] == 1)


def _put_for_body(inode: int, body_len: int) -> tuple[str, bytes]:
    """A key and a sealed block whose put request body is exactly `body_len`
    bytes (request ids below 128; the volume name absorbs what the block's
    size cannot hit, since a 16-byte tag comes with every chunk)."""
    def length(key: str, blob_len: int) -> int:
        head = wire.pack({"id": 1, "op": "put", "key": key, "data": b""})
        return len(head) - 2 + len(wire.bin_header(blob_len)) + blob_len

    plain = body_len - 200
    while True:
        key = make_key(vol="v", inode=inode)
        blob = make_block(key, plain)
        short = body_len - length(key, len(blob))
        if 0 <= short < 40:
            key = make_key(vol="v" * (1 + short), inode=inode)
            blob = make_block(key, plain)
            assert length(key, len(blob)) == body_len
            return key, blob
        plain += 1 if short > 0 else -1


@pytest.mark.parametrize("pipelined", [False, True])
def test_put_frames_of_every_size_boundary_are_stored_exactly(daemon, pipelined):
    """Bodies around the small-frame limit, the read size and the pool's size
    classes, sent one by one or back to back in one write (a frame then starts
    in the middle of a read): every block lands byte for byte."""
    sizes = [SMALL_FRAME - 1, SMALL_FRAME, SMALL_FRAME + 1, READ_SIZE - 5, READ_SIZE - 4,
             READ_SIZE - 3, READ_SIZE, 3 * FRAME_CLASS - 1, 3 * FRAME_CLASS, 3 * FRAME_CLASS + 1,
             (1 << 20) + 1]
    puts = [_put_for_body(100 + i, n) for i, n in enumerate(sizes)]
    c = daemon.client()
    if pipelined:
        replies = pipeline(c, [("put", {"key": k, "data": b}) for k, b in puts])
        assert [(r["accepted"], r["reason"]) for r in replies] == [(True, "queued")] * len(puts)
    else:
        assert [c.put(k, b) for k, b in puts] == [(True, "queued")] * len(puts)
    daemon.wait_idle()
    paths = c.lookup([k for k, _ in puts])
    for (key, blob), path in zip(puts, paths):
        assert path is not None and Path(path).read_bytes() == blob, key
    assert c.stats()["errors"] == {}


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_clients_hanging_up_mid_large_frame_are_counted_and_leak_nothing(daemon):
    """150 puts of 1 MiB cut off half way (more than the 128 MiB read budget in
    all): each is counted as a bad frame, its connection, read budget and frame
    buffer are given back, so a whole put then goes through and the daemon's
    memory has not grown by what the half frames held."""
    key = make_key(inode=7)
    frame = protocol.encode_frame({"id": 1, "op": "put", "key": key,
                                   "data": make_block(key, 1 << 20)})
    c = daemon.client()
    c.ping()
    rss = _rss_bytes(daemon.proc.pid)
    for _ in range(3):
        socks = [_raw(daemon.socket_path) for _ in range(50)]
        for s in socks:
            s.sendall(frame[:len(frame) // 2])
        for s in socks:
            s.close()
        daemon.wait_stats(lambda s: s["connections"] == 2)  # c and wait_stats' own
    assert c.stats()["errors"] == {ErrorCode.BAD_FRAME: 150}
    assert c.put(key, make_block(key, 1 << 20)) == (True, "queued")
    daemon.wait_idle()
    assert c.lookup([key])[0] is not None
    # 50 half frames at a time: the next rounds reuse the 50 pooled buffers
    # (~53 MiB); frames that leaked would hold ~160 MiB
    assert _rss_bytes(daemon.proc.pid) - rss < 100 << 20


def test_client_times_out_on_a_stopped_daemon_then_reconnects(daemon):
    c = Client(daemon.socket_path, timeout=0.3)
    c.ping()
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(DaemonUnavailable, match="timed out after 0.3s"):
            c.lookup([make_key()])
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert c.ping()["ok"]
    c.close()


# Run in a new process: how many threads the test process has left running
# (other tests' volumes, servers) must not decide whether the client spins.
_SLEEPS_PER_LOOKUP = """
import os, resource, sys, threading
from blockcache_client.daemonclient.client import Client
sock, spin, cpu = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
extra_thread = sys.argv[4] == "1"
os.sched_setaffinity(0, {cpu})
if extra_thread:
    threading.Thread(target=threading.Event().wait, daemon=True).start()
client, n = Client(sock, reply_spin=spin), 2000
client.ping()
key = sys.argv[5]
before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
for _ in range(n):
    client.lookup([key])
print((resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before) / n)
"""


def _sleeps_per_lookup(daemon, reply_spin: float, extra_thread: bool = False) -> float:
    """Times a client thread slept per 1-key lookup, with client and daemon
    on different CPUs (each sleep is then a cross-CPU wake-up)."""
    cpus = sorted(os.sched_getaffinity(0))
    daemons = os.sched_getaffinity(daemon.proc.pid)
    os.sched_setaffinity(daemon.proc.pid, {cpus[1]})
    try:
        out = subprocess.run([sys.executable, "-c", _SLEEPS_PER_LOOKUP, daemon.socket_path,
                              str(reply_spin), str(cpus[0]), "1" if extra_thread else "0",
                              make_key()], capture_output=True, text=True, timeout=60,
                             cwd=str(Path(__file__).parents[2]))
    finally:
        os.sched_setaffinity(daemon.proc.pid, daemons)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_client_sleeps_once_per_request(daemon):
    """A client waits for its reply in poll, which only input wakes. Blocked
    in recv instead, it was also woken (for nothing) when the daemon consumed
    its request, a write-space wake-up of every task sleeping on the socket:
    with client and daemon on different CPUs, nearly every request slept twice."""
    assert _sleeps_per_lookup(daemon, reply_spin=0) < 1.3


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_single_threaded_client_polls_for_its_reply_before_sleeping(daemon):
    """Alone in its process, a client polls (yielding the CPU) for a while
    before it sleeps, so a prompt reply costs it no wake-up; with another
    Python thread alive it sleeps at once rather than hold the GIL."""
    patient = 0.05  # far longer than any lookup takes, so no request sleeps
    assert _sleeps_per_lookup(daemon, reply_spin=patient) < 0.2
    assert _sleeps_per_lookup(daemon, reply_spin=patient, extra_thread=True) > 0.5


def test_posted_puts_are_answered_in_order_and_survive_other_calls(daemon):
    """`post` sends without waiting; a plain call in between keeps the posted
    replies for `collect`, which returns them in posting order."""
    c = Client(daemon.socket_path)
    keys = [make_key(inode=i + 1) for i in range(5)]
    for k in keys[:3]:
        assert c.post("put", {"key": k, "data": make_block(k)}) is None
    assert c.ping()["ok"]  # reads past the three put replies
    for k in keys[3:]:
        assert c.post("put", {"key": k, "data": make_block(k)}) is None
    assert c.posted == 5
    replies = c.collect(wait=True)
    assert [r["accepted"] for r in replies] == [True] * 5
    assert [r["id"] for r in replies] == sorted(r["id"] for r in replies)
    assert c.posted == 0 and c.collect() == []
    daemon.wait_idle()
    assert all(c.lookup(keys))
    c.close()


def test_a_post_the_socket_cannot_take_leaves_its_tail_to_send(daemon):
    """With the daemon not reading, `post` returns at once with the part of
    the frame that did not fit; `finish_post` sends it and the block lands
    whole."""
    c = Client(daemon.socket_path, timeout=10)
    c.ping()
    key = make_key(inode=77)
    block = make_block(key, 12 << 20)  # more than the socket buffers hold
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        tail = c.post("put", {"key": key, "data": block})
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert tail is not None and 0 < sum(map(len, tail)) < len(block)
    c.finish_post(tail)
    assert c.collect(wait=True)[0]["accepted"]
    daemon.wait_idle()
    path = c.lookup([key])[0]
    with open(path, "rb") as f:
        assert f.read() == block
    c.close()


def test_a_client_whose_replies_come_late_stops_spinning_for_a_while(daemon, monkeypatch):
    """Replies later than the spin (a daemon short of CPU) make the client
    sleep at once for the next requests, more of them each time, rather than
    take CPU the daemon needs; a prompt reply makes it spin again."""
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # as if alone
    late = Client(daemon.socket_path, reply_spin=1e-7)  # every reply is late
    batch = [make_key(inode=i + 1) for i in range(protocol.MAX_BATCH)]  # ms to answer
    for _ in range(150):
        late.lookup(batch)
    assert late._spin_backoff == 64  # doubled up to its cap, skipping more each time
    patient = Client(daemon.socket_path, reply_spin=0.05)
    patient._spin_backoff = 8
    patient.lookup([make_key()])  # (skips the spin: 0 to skip yet)
    patient.lookup([make_key()])
    assert patient._spin_backoff == 0
    late.close()
    patient.close()
