"""Fetch leases at the socket: a real daemon and raw clients, some of them
other uids. How a run is granted, what a waiter is told and when, what a
lease's holder may and may not do, and that the table is bounded per uid."""

from __future__ import annotations

import os
import pwd
import socket
import threading
import time

import pytest

from blockcache_client.contract import blockfile
from blockcache_client.contract.blockkey import BlockKey
from blockcache_client.contract.errors import DaemonError
from blockcache_client.contract.protocol import decode_body, encode_frame, frame_length
from blockcache_client.daemonclient.client import Client
from devtools.daemon import DaemonProcess
from tests.support.cli_runs import run_cli
from tests.support.metrics import logged_port, scrape, value
from tests.support.uids import as_uid
from tests.support.waiting import wait_for

VOLUME_KEY = bytes(range(32))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (other uids)")


def keys(vol: str = "vol", n: int = 4, inode: int = 7) -> list[str]:
    return [str(BlockKey(vol, inode, 0xabc, i << 16)) for i in range(n)]


def sealed(key: str) -> bytes:
    return blockfile.seal(key, b"x" * 1000, VOLUME_KEY)


def _daemon(tmp_path, *args: str) -> DaemonProcess:
    return DaemonProcess(tmp_path, extra_args=list(args)).start()


class Waiter:
    """A `wait` on a connection of its own, in a thread; `outcome` once answered."""

    def __init__(self, d: DaemonProcess, key: str):
        self.client = d.client(timeout=30)
        self.outcome: str | None = None
        self.answered_at = 0.0
        self._thread = threading.Thread(target=self._wait, args=(key,), daemon=True)
        self._thread.start()

    def _wait(self, key: str) -> None:
        self.outcome = self.client.wait(key)
        self.answered_at = time.monotonic()

    def result(self, timeout: float = 10) -> str | None:
        self._thread.join(timeout)
        return self.outcome


def _waiting(d: DaemonProcess, n: int) -> None:
    wait_for(lambda: d.client().stats()["leases"]["waiting"] == n, what=f"{n} waiting")


def test_a_run_is_granted_in_order_up_to_the_first_block_another_holds(tmp_path):
    d = _daemon(tmp_path)
    try:
        a, b = d.client(), d.client()
        k = keys(n=6)
        assert a.lease(k[2:4]) == ["granted", "granted"]
        assert a.put(k[4], sealed(k[4]))[0]
        d.wait_idle()
        # b's run stops at a's block: it fetches k0, k1 in one request; the
        # blocks after the first it may not fetch are not granted either
        assert b.lease(k) == ["granted", "granted", "held", "held", "cached", "none"]
        assert a.lease(k[:3]) == ["held", "held", "granted"]  # a's own: still a's
        assert b.release(k) == 2 and a.release(k) == 2
        assert d.client().stats()["leases"]["held"] == 0
    finally:
        d.stop()


def test_a_waiter_is_told_how_the_lease_ended_as_it_ends(tmp_path):
    d = _daemon(tmp_path, "--lease-timeout", "1", "--max-volumes", "1")
    try:
        holder = d.client()
        k = keys(n=5)
        assert holder.lease(k) == ["granted"] * 5
        waiters = [Waiter(d, key) for key in k[:4]]
        _waiting(d, 4)
        assert holder.put(k[0], sealed(k[0]))[0]  # lands: filled
        assert waiters[0].result() == "filled"
        assert holder.release([k[1]]) == 1
        assert waiters[1].result() == "released"
        other = str(BlockKey("other", 7, 0xabc, 0))  # a second volume: not cached
        assert holder.lease([other]) == ["granted"]
        late = Waiter(d, other)
        _waiting(d, 3)
        assert holder.put(other, sealed(other)) == (False, "too_many_volumes")
        assert late.result() == "declined"
        granted = time.monotonic()
        assert waiters[2].result() == waiters[3].result() == "expired"  # nobody filled them
        assert waiters[2].answered_at - granted < 1.5
        # nothing to wait for: at once
        assert d.client().wait(k[0]) == "filled" and d.client().wait(k[2]) == "free"
        le = d.client().stats()["leases"]
        assert (le["filled"], le["released"], le["declined"], le["expired"]) == (1, 1, 1, 3)
        assert le["held"] == le["waiting"] == 0 and le["saved"] == 2
    finally:
        d.stop()


def test_a_holder_gone_loses_its_leases_but_not_a_block_it_put(tmp_path):
    d = _daemon(tmp_path)
    try:
        holder = d.client()
        k = keys(n=3)
        assert holder.lease(k) == ["granted"] * 3
        waiters = [Waiter(d, key) for key in k]
        _waiting(d, 3)
        # its last put answered, it closes (a reader closing once its fills
        # are answered): that block, queued or written, is filled
        assert holder.put(k[2], sealed(k[2])) == (True, "queued")
        holder.close()  # as a killed process's connection closes
        assert [w.result() for w in waiters] == ["lost", "lost", "filled"]
        assert d.client().lease(k) == ["granted", "granted", "cached"]  # free again
    finally:
        d.stop()


def test_a_wait_holds_back_its_connection_and_lets_the_others_go(tmp_path):
    d = _daemon(tmp_path, "--lease-timeout", "1")
    try:
        k = keys(n=1)
        assert d.client().lease(k) == ["granted"]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        try:
            sock.connect(d.socket_path)
            sock.sendall(encode_frame({"id": 1, "op": "wait", "key": k[0]})
                         + encode_frame({"id": 2, "op": "ping"}))
            start = time.monotonic()
            assert d.client().ping()  # others are answered meanwhile
            first = _reply(sock)
            assert first["id"] == 1 and first["outcome"] == "expired"
            assert time.monotonic() - start > 0.5  # the ping waited behind it
            assert _reply(sock)["id"] == 2
        finally:
            sock.close()
    finally:
        d.stop()


def _reply(sock: socket.socket) -> dict:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            assert chunk, "the daemon closed the connection"
            buf += chunk
        return buf
    return decode_body(exactly(frame_length(exactly(4))))


def test_leases_off_grant_nothing(tmp_path):
    d = _daemon(tmp_path, "--lease-timeout", "0")
    try:
        c = d.client()
        assert c.hello()["lease_timeout"] == 0
        assert c.lease(keys(n=2)) == ["none", "none"]
        assert c.wait(keys(n=1)[0]) == "free"
    finally:
        d.stop()


def _try(path: str, fn: str, *args):
    with Client(path, timeout=5) as c:
        try:
            return getattr(c, fn)(*args)
        except DaemonError as exc:
            return exc.code


@needs_root
def test_a_uid_without_access_to_a_volume_cannot_take_its_leases(tmp_path, shared_dir):
    nobody = pwd.getpwnam("nobody")
    d = DaemonProcess(tmp_path, cache_dirs=[(os.path.join(shared_dir, "cache"), "64M")],
                      extra_args=["--socket-mode", "0666", "--volume-access", "victim=uid:0",
                                  "--volume-access", f"mine=uid:{nobody.pw_uid}"])
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    d.start()
    try:
        victim, mine = keys("victim", 2), keys("mine", 2)
        root = d.client()
        assert root.lease(victim[1:]) == ["granted"]

        def attempt(op, *args):
            return as_uid(nobody.pw_uid, nobody.pw_gid, _try, d.socket_path, op, *args)
        assert attempt("lease", victim) == "permission_denied"
        assert attempt("wait", victim[1]) == "permission_denied"  # nor learn of its fills
        assert attempt("release", victim) == "permission_denied"
        assert attempt("lease", mine) == ["granted", "granted"]  # its own volume: yes
        le = root.stats()["leases"]
        assert le["taken"] == 3 and le["held"] == 1  # its own ended with its connection
        assert root.lease(victim) == ["granted", "granted"]  # nothing of nobody's
    finally:
        d.stop()


@needs_root
def test_leases_are_bounded_per_uid_and_an_admin_keeps_its_own(tmp_path, shared_dir):
    nobody = pwd.getpwnam("nobody")
    d = DaemonProcess(tmp_path, cache_dirs=[(os.path.join(shared_dir, "cache"), "64M")],
                      extra_args=["--socket-mode", "0666", "--max-leases-per-uid", "3",
                                  "--metrics-addr", "127.0.0.1:0"])
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    d.start()
    try:
        def hoard(path):
            c = Client(path, timeout=5)  # kept open: the leases stay held
            first = c.lease(keys("a", 5))
            second = c.lease(keys("b", 2))
            return first, second, c.stats()["leases"]
        first, second, le = as_uid(nobody.pw_uid, nobody.pw_gid, hoard, d.socket_path)
        assert first == ["granted"] * 3 + ["none"] * 2 and second == ["none", "none"]
        assert le["held"] == 3 and le["refused"] == 2 and le["per_uid"] == 3
        assert d.client().lease(keys("c", 5)) == ["granted"] * 5  # root: an admin
        s = d.client().stats()
        assert s["refused"]["lease_share"] == 2
        port = logged_port(d.stderr)
        samples = scrape(port)
        assert value(samples, "blockcache_leases_taken_total") == 8
        assert value(samples, "blockcache_leases_refused_total") == 2
        assert value(samples, "blockcache_leases_held") == 5
        assert value(samples, "blockcache_leases_ended_total", how="lost") == 3
        out = run_cli("blockcache_client.cli", "--socket", d.socket_path, "stats")
        assert out.returncode == 0, out.stderr
        assert ("leases       taken 8, waits 0, fetches saved 0, expired 0, holders lost 3; "
                "held 5, waiting 0") in out.stdout, out.stdout
        lines = [line for line in d.stderr().splitlines()
                 if f"refused uid {nobody.pw_uid}" in line and "max_leases_per_uid" in line]
        assert len(lines) == 1, lines
    finally:
        d.stop()
