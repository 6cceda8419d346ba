"""The keeper: a mount outlives its server. Real mounts, a real daemon, a reader
in its own process (working directory in the mount) verifying every byte while
the server is killed with SIGKILL, restarted live, or the keeper itself killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from fsclient import keeper as keeping
from fsclient import mountpoint
from fsclient.keeper import surrender
from tests.support.fsclient_mounts import REPO, env
from tests.support.keepers import Reader, copy_connected_sockets, kill_server, serving
from tests.support.waiting import wait_for

pytestmark = pytest.mark.fuse

def test_server_killed_20_times_fails_no_read(tree, daemon, mounts, tmp_path):
    # metadata cached (the default TTL): a new server's cold caches and
    # background listings meet the kernel's cached entries
    m = mounts(tree, daemon.socket_path, args=["--meta-ttl", "60"])
    reader = Reader(m.mountpoint, tree, tmp_path)
    try:
        time.sleep(1.0)  # the reader is under way: files open, cwd in the mount
        for _ in range(20):
            old = kill_server(m.mountpoint)
            serving(m.mountpoint, other_than=old)
            time.sleep(0.3)
        tally = reader.finish()
    finally:
        reader.kill()
    assert tally["failed"] == {} and tally["wrong"] == 0, tally
    assert tally["ok"] > 100, tally
    assert keeping.status(m.mountpoint)["restarts"] == 20
    assert "requests resent" in m.log()
    # `fsclient status`: the last server found the reader's nodes in the saved
    # state and made its held file's handle again
    res = subprocess.run([sys.executable, "-m", "fsclient.cli", "status", "--json",
                          m.mountpoint], capture_output=True, text=True, timeout=60,
                         env=env(), cwd=REPO)
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    assert status["restarts"] == 20, status
    assert status["nodes_recovered"] > 0 and status["handles_recovered"] > 0, status
    # this kernel resends (6.9+): status says kill -9 costs nothing
    assert status["fuse_minor"] >= 40 and "the kernel resends" in status["restart"], status


def test_restart_under_load_fails_no_read(tree, daemon, mounts, tmp_path):
    m = mounts(tree, daemon.socket_path, args=["--meta-ttl", "0"])
    reader = Reader(m.mountpoint, tree, tmp_path)
    try:
        time.sleep(1.0)
        before = serving(m.mountpoint)
        for _ in range(3):
            res = subprocess.run([sys.executable, "-m", "fsclient.cli", "restart",
                                  m.mountpoint], capture_output=True, text=True, timeout=120,
                                 env=env(), cwd=REPO)
            assert res.returncode == 0, res.stderr
            assert "restarted" in res.stdout
        tally = reader.finish()
    finally:
        reader.kill()
    assert tally["failed"] == {} and tally["wrong"] == 0, tally
    after = keeping.status(m.mountpoint)
    assert after["server"] != before and after["restarts"] == 3
    assert "handed" in m.log() and m.proc.poll() is None  # the keeper never left


def test_a_keeper_answers_while_its_old_server_is_slow_to_hand_over(tree, daemon, mounts):
    """A restart whose old server does not hand over at once (stopped here; a
    server hung on its remote in practice) leaves the keeper answering: its
    status at once, a surrender refused; the restart completes when the old
    server goes."""
    m = mounts(tree, daemon.socket_path)
    old = serving(m.mountpoint)
    os.kill(old, signal.SIGSTOP)
    answer: list = []
    restart = threading.Thread(target=lambda: answer.append(keeping.restart(m.mountpoint)),
                               daemon=True)
    try:
        restart.start()
        wait_for(lambda: f"server {old} hands over" in m.log(), 60,
                 "the new server to have its volume open")
        # answered while the old server is still stopped (the keeper used to
        # wait for it up to HANDOVER_TIMEOUT, past status's 10 s)
        status = keeping.status(m.mountpoint)
        assert status["server"] == old and status["serving"], status
        with pytest.raises(ValueError, match="not serving steadily"):
            surrender(m.mountpoint, 10).close()
        assert restart.is_alive()  # (no answer while the old server is stopped)
    finally:
        os.kill(old, signal.SIGCONT)
    restart.join(60)
    assert answer and answer[0]["server"] != old, answer
    assert keeping.status(m.mountpoint)["restarts"] == 1
    assert sorted(os.listdir(m.mountpoint)) == sorted(os.listdir(tree))


def test_mount_on_a_live_mount_restarts_its_server(tree, key_file, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    before = serving(m.mountpoint)
    res = subprocess.run([sys.executable, "-m", "fsclient.cli", "mount", str(tree),
                          m.mountpoint, "--volume", "testvol", "--key-file", str(key_file),
                          "--socket", daemon.socket_path], capture_output=True, text=True,
                         timeout=120, env=env(), cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "restarted" in res.stderr
    assert serving(m.mountpoint) != before
    assert sorted(os.listdir(m.mountpoint)) == sorted(os.listdir(tree))


def test_a_killed_keeper_is_replaced_by_its_server_and_no_read_fails(tree, daemon, mounts,
                                                                     tmp_path):
    """The keeper killed alone: its server starts a new keeper, hands it the
    connection, and hands over to that keeper's server (`keeper.successor`)."""
    m = mounts(tree, daemon.socket_path)
    before = keeping.status(m.mountpoint)
    reader = Reader(m.mountpoint, tree, tmp_path)
    after: dict = {}
    try:
        time.sleep(0.5)  # the reader is under way: files open, cwd in the mount
        m.proc.kill()
        m.proc.wait(10)

        def replaced() -> bool:
            try:
                after.update(keeping.status(m.mountpoint))
            except Exception:  # (no keeper answers yet)
                return False
            return after["keeper"] != before["keeper"] and after["serving"]
        deadline = time.monotonic() + 60
        while not replaced():
            assert time.monotonic() < deadline, "no new keeper took the mount over"
            time.sleep(0.1)
        assert after["server"] != before["server"]
        time.sleep(0.5)
        tally = reader.finish()
        assert tally["failed"] == {} and tally["wrong"] == 0, tally
        assert tally["ok"] > 0, tally
        assert "started keeper" in m.log() and "handed" in m.log()
        # (what a server that may not search the path knows the mount's device by)
        assert mountpoint.find_mount(m.mountpoint).device == os.stat(m.mountpoint).st_dev
        # a keeper like any other: `fsclient umount` ends it and its server
        res = subprocess.run([sys.executable, "-m", "fsclient.cli", "umount", m.mountpoint],
                             capture_output=True, text=True, timeout=60, env=env(), cwd=REPO)
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{after['keeper']}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{after['keeper']}")
    finally:
        reader.kill()
        for pid in (after.get("keeper"), after.get("server")):
            if pid and os.path.exists(f"/proc/{pid}"):
                os.kill(pid, 9)


def test_mount_waits_for_the_server_of_a_dead_keeper(tree, key_file, daemon, mounts,
                                                    tmp_path):
    """The keeper killed alone, and a new `fsclient mount` there before its
    server noticed: that mount holds the mount point's control socket, so the
    keeper the server starts cannot take over, and the server ends the mount
    (`keeper.successor`'s fallback). The new mount waits for the mount to go
    dead and recovers it, instead of calling the mount point busy."""
    m = mounts(tree, daemon.socket_path)
    orphan = keeping.status(m.mountpoint)["server"]
    # hold the window open: with copies of the keeper's link, its server does
    # not see the keeper gone until the copies close
    links = copy_connected_sockets(m.proc.pid)
    errors = tmp_path / "again.err"
    try:
        m.proc.kill()
        m.proc.wait(10)
        with open(errors, "wb") as err:
            again = subprocess.Popen(
                [sys.executable, "-m", "fsclient.cli", "mount", str(tree), m.mountpoint,
                 "--volume", "testvol", "--key-file", str(key_file), "--socket",
                 daemon.socket_path], stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                env=env(), cwd=REPO)
        # the new mount meets the orphan's mount, live, and waits for it
        deadline = time.monotonic() + 60
        while "keeper is gone" not in errors.read_text() and time.monotonic() < deadline:
            assert again.poll() is None, errors.read_text()
            time.sleep(0.05)
        assert os.path.exists(f"/proc/{orphan}")
    finally:
        for fd in links:
            os.close(fd)
    try:
        assert again.wait(120) == 0, errors.read_text()
    finally:
        again.kill() if again.poll() is None else None
    assert "dead FUSE mount" in errors.read_text(), errors.read_text()
    try:
        assert sorted(os.listdir(m.mountpoint)) == sorted(os.listdir(tree))
        assert serving(m.mountpoint) != orphan
    finally:
        subprocess.run([sys.executable, "-m", "fsclient.cli", "umount", m.mountpoint],
                       capture_output=True, timeout=60, env=env(), cwd=REPO)
