"""Kernels before 6.9 (FUSE 7.39, no FUSE_NOTIFY_RESEND), tested on this one with
the negotiated minor forced to 39 (FSCLIENT_FUSE_MINOR). A request a server read
and left unanswered is never answered there, so a server that stops answers all
it read first: a restart, a takeover and a killed keeper's successor under four
readers that get no signal (as DataLoader workers) leave no read waiting, each
bounded by a watchdog, and nothing for the next server to answer. What a kill -9
strands, the next server answers EINTR: the kernel reads the page again, and
Python retries the rest; five kills under the readers hang and fail none.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import suppress

import pytest

from fsclient import keeper as keeping
from tests.fsclient.conftest import BLOCK
from tests.support.fsclient_mounts import FsclientMount, fsclient
from tests.support.hangwatch import BOUND, Readers
from tests.support.keepers import kill_server, serving, surrender_to

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(BOUND + 120)]

DELAY = 1.0  # each remote request of the slow source


def _slow_source(tmp_path, tree, delay: float) -> tuple[str, list[str]]:
    """A source whose every remote request takes `delay`, and the mount's args."""
    config = tmp_path / "slow.toml"
    config.write_text(f"[storage_options]\nlatency = {{delay = {delay}}}\n")
    return f"latency::file://{tree}", ["--config", str(config)]


@pytest.fixture(autouse=True)
def fuse_7_39(monkeypatch):
    monkeypatch.setenv("FSCLIENT_FUSE_MINOR", "39")


def _no_read_hung_or_failed(readers: Readers, before: list[int]) -> None:
    tallies = readers.finish()
    for i, t in enumerate(tallies):
        assert t["failed"] == {} and t["wrong"] == 0, (i, t)
    # every reader read on after the last change of server
    assert all(t["ok"] > b for t, b in zip(tallies, before)), (tallies, before)


def test_restart_on_fuse_7_39_leaves_no_reader_waiting(tree, daemon, mounts, tmp_path):
    m = mounts(tree, daemon.socket_path, args=["--meta-ttl", "0"])
    readers = Readers(m.mountpoint, tree, tmp_path)
    try:
        readers.watch(1.0)  # under way: files open, reads queued
        for _ in range(3):
            res = fsclient("restart", m.mountpoint)
            assert res.returncode == 0, res.stderr
            readers.watch(2.0)
        _no_read_hung_or_failed(readers, readers.done())
    finally:
        readers.kill()
    assert "FUSE 7.39" in m.log() and "requests resent" not in m.log()
    assert "all requests answered" in m.log(), m.log()
    assert "answered EINTR" not in m.log()  # the drain left the next server nothing
    res = fsclient("status", "--json", m.mountpoint)
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    assert status["restarts"] == 3 and status["fuse_minor"] == 39, status
    assert "kill -9 answers" in status["restart"] and "no resend" in status["restart"], status


def test_takeover_on_fuse_7_39_leaves_no_reader_waiting(tree, key_file, daemon, tmp_path):
    # each open stats the slow source: the handover waits for some while the
    # readers' other requests keep coming, and are read, during the drain
    mp = str(tmp_path / "mnt")
    source, slow = _slow_source(tmp_path, tree, 0.2)
    keepers = [FsclientMount(source, mp, key_file, daemon.socket_path,
                             args=["--block-size", str(BLOCK), "--meta-ttl", "0", *slow],
                             log_path=str(tmp_path / f"{name}.log"), own_session=True)
               for name in ("old", "new")]
    old, new = keepers
    readers = None
    try:
        old.start()
        readers = Readers(mp, tree, tmp_path)
        readers.watch(1.0)
        surrender_to(mp, new)
        old.proc.wait(60)  # its server answered all it read, handed over, and left
        assert keeping.status(mp)["keeper"] == new.proc.pid
        readers.watch(2.0)
        _no_read_hung_or_failed(readers, readers.done())
        assert "all requests answered" in old.log(), old.log()
        assert "no resend" in new.log() and "answered EINTR" not in new.log()
    finally:
        if readers is not None:
            readers.kill()
        for m in keepers:
            m.stop()
            if m.proc is not None:
                with suppress(ProcessLookupError):
                    os.killpg(m.proc.pid, signal.SIGKILL)


def test_a_killed_keeper_on_fuse_7_39_leaves_no_reader_waiting(tree, daemon, mounts,
                                                                tmp_path):
    # its server starts the next keeper and hands over to that keeper's
    # server: it answers all it read first (keeper.successor); a slow source,
    # as for the takeover
    source, slow = _slow_source(tmp_path, tree, 0.2)
    m = mounts(source, daemon.socket_path, args=["--meta-ttl", "0", *slow])
    before = keeping.status(m.mountpoint)
    readers = Readers(m.mountpoint, tree, tmp_path)
    after: dict = {}
    try:
        readers.watch(1.0)
        m.proc.kill()
        m.proc.wait(10)
        deadline = time.monotonic() + 60
        while not (after.get("serving") and after["keeper"] != before["keeper"]):
            assert time.monotonic() < deadline, "no new keeper took the mount over"
            readers.watch(0.2)
            with suppress(Exception):  # (no keeper answers yet)
                after.update(keeping.status(m.mountpoint))
        readers.watch(2.0)
        _no_read_hung_or_failed(readers, readers.done())
        assert "started keeper" in m.log() and "all requests answered" in m.log()
        assert "answered EINTR" not in m.log()
    finally:
        readers.kill()
        for pid in (after.get("keeper"), after.get("server")):
            if pid:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_kill_9_on_fuse_7_39_under_readers_hangs_none(tree, daemon, mounts, tmp_path):
    # the finding: one kill -9 left a reader with no signal waiting past 60 s
    m = mounts(tree, daemon.socket_path, args=["--meta-ttl", "0"])
    readers = Readers(m.mountpoint, tree, tmp_path)
    try:
        readers.watch(1.0)
        for _ in range(5):
            old = kill_server(m.mountpoint)
            serving(m.mountpoint, other_than=old)
            readers.watch(1.0)
        _no_read_hung_or_failed(readers, readers.done())
    finally:
        readers.kill()
    assert "no resend" in m.log() and "answered EINTR" in m.log()


def test_kill_9_on_fuse_7_39_the_next_server_answers_what_it_had_read(tmp_path, tree,
                                                                       daemon, mounts):
    # a read in a cold remote fetch when its server is killed: nothing resends
    # it; the next server answers it EINTR, and the kernel reads the page again
    source, slow = _slow_source(tmp_path, tree, DELAY)
    m = mounts(source, daemon.socket_path, args=slow)
    want = (tree / "big.bin").read_bytes()[17 * BLOCK:17 * BLOCK + 8192]
    fd = os.open(os.path.join(m.mountpoint, "big.bin"), os.O_RDONLY)
    got: list = []
    try:
        t = threading.Thread(target=lambda: got.append(os.pread(fd, 8192, 17 * BLOCK)),
                             daemon=True)
        t.start()
        time.sleep(DELAY / 2)  # the fetch is under way on the server
        old = kill_server(m.mountpoint)
        serving(m.mountpoint, other_than=old)
        t.join(BOUND)
        assert got == [want], m.log()[-3000:]
        assert "no resend" in m.log() and "answered EINTR 1 requests" in m.log()
    finally:
        os.close(fd)
