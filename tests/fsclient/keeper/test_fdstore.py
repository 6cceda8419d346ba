"""Under systemd: the keeper keeps the connection in the unit's file descriptor
store, and a restart of the whole unit takes the live mount over from
LISTEN_FDS; a stop unmounts; a keeper that dies leaves the mount to the store
even when systemd then signals the rest of the unit. A socket here plays
systemd's side (NOTIFY_SOCKET, FDSTORE, then LISTEN_FDS and LISTEN_FDNAMES for
the next start, or dropping the store on a stop); a reader verifies every byte
across a restart."""

from __future__ import annotations

import array
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fsclient.keeper.handoff import RESTART_SIGNAL
from tests.support.fsclient_mounts import REPO, env, force_unmount, fsclient, is_mounted
from tests.support.keepers import Reader, serving

pytestmark = pytest.mark.fuse

WAIT = 60.0


class FakeSystemd:
    """The notify socket and the fd store of one unit."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(WAIT)
        self.path = path
        self.store: dict[str, list[int]] = {}
        self.states: list[str] = []

    def receive_until(self, wanted: str) -> None:
        while wanted not in self.states:
            data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(64 * 4))
            fds = array.array("i")
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            if fields.get("FDSTORE") == "1":
                self.store.setdefault(fields["FDNAME"], []).extend(fds)
                assert fields.get("FDPOLL") == "0"
                self.states.append("FDSTORE " + fields["FDNAME"])
            elif fields.get("FDSTOREREMOVE") == "1":
                for fd in self.store.pop(fields["FDNAME"], []):
                    os.close(fd)
                self.states.append("FDSTOREREMOVE " + fields["FDNAME"])
            else:
                self.states.append(data.decode())

    def start(self, argv: list[str], log_path: str) -> subprocess.Popen:
        """Start the unit's process, with the stored descriptors from fd 3 on."""
        names = [n for n in ("fuse", "saved") for _ in self.store.get(n, [])]
        fds = [fd for n in ("fuse", "saved") for fd in self.store.get(n, [])]
        e = dict(env(), NOTIFY_SOCKET=self.path)
        if fds:
            e.update(LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=":".join(names))

        def place() -> None:  # in the child: fds to 3.. (high first, so none is clobbered)
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 200) for fd in fds]
            for i, fd in enumerate(high):
                os.dup2(fd, 3 + i)

        cmd = ["sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", *argv] if fds else argv
        with open(log_path, "ab") as out:
            return subprocess.Popen(cmd, env=e, cwd=REPO, stdout=out, stderr=out,
                                    stdin=subprocess.DEVNULL, preexec_fn=place,
                                    close_fds=not fds)

    def release(self) -> None:
        """Drop the stored descriptors, as systemd does once a stopped unit is dead."""
        for fds in self.store.values():
            for fd in fds:
                os.close(fd)
        self.store.clear()

    def close(self) -> None:
        self.release()
        self.sock.close()


class Unit:
    """One fsclient@ unit played by `FakeSystemd`: its starts, its processes,
    and a verifying reader of its mount."""

    def __init__(self, tree, key_file, daemon, tmp_path):
        self.tree, self.tmp_path = tree, tmp_path
        self.mp = str(tmp_path / "mnt")
        os.makedirs(self.mp)
        self.argv = [sys.executable, "-m", "fsclient.cli", "--log-level", "debug", "mount",
                     str(tree), self.mp, "--volume", "testvol", "--key-file", str(key_file),
                     "--socket", daemon.socket_path, "--meta-ttl", "0", "--foreground"]
        self.systemd = FakeSystemd(str(tmp_path / "notify.sock"))
        self.log = str(tmp_path / "unit.log")
        self.procs: list[subprocess.Popen] = []
        self.reader: Reader | None = None

    def start(self) -> None:
        """The first start (--foreground: the process is the keeper)."""
        self.procs.append(self.systemd.start(self.argv, self.log))
        self.systemd.receive_until("READY=1")

    def read(self) -> None:
        self.reader = Reader(self.mp, self.tree, self.tmp_path)

    def next_start_takes_over(self) -> dict:
        """Start the unit again, as shipped (Type=forking: `fsclient mount` gets
        LISTEN_FDS and passes them on to the keeper it starts, then exits 0
        once it serves); the reader's tally: no read failed meanwhile."""
        self.systemd.states.clear()
        self.procs.append(self.systemd.start([*self.argv[:-1], "--log-file", self.log],
                                             self.log))
        assert self.procs[-1].wait(WAIT) == 0
        self.systemd.receive_until("READY=1")
        serving(self.mp)
        time.sleep(1.0)
        assert self.reader is not None
        tally = self.reader.finish()
        assert tally["failed"] == {} and tally["wrong"] == 0, tally
        assert "taking over" in open(self.log).read()
        return tally

    def close(self) -> None:
        if self.reader is not None:
            self.reader.kill()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        self.systemd.close()
        force_unmount(self.mp)


@pytest.fixture
def unit(tree, key_file, daemon, tmp_path):
    u = Unit(tree, key_file, daemon, tmp_path)
    try:
        yield u
    finally:
        u.close()


def test_a_unit_restart_keeps_the_mount_through_the_fd_store(unit):
    unit.start()
    systemd = unit.systemd
    assert {"FDSTORE fuse", "FDSTORE saved"} <= set(systemd.states)
    assert len(systemd.store["saved"]) == 1 and systemd.store["fuse"]
    unit.read()
    time.sleep(1.0)
    server = serving(unit.mp)
    # systemctl restart (KillMode=control-group): every process of the unit
    # gets RestartKillSignal=, the server too; neither unmounts
    unit.procs[0].send_signal(RESTART_SIGNAL)
    os.kill(server, RESTART_SIGNAL)
    assert unit.procs[0].wait(WAIT) == 0
    assert is_mounted(unit.mp)  # kept: systemd holds the connection
    assert unit.next_start_takes_over()["ok"] > 50
    # `fsclient umount` ends the mount; the unit asks systemd to drop the descriptors
    assert fsclient("umount", unit.mp).returncode == 0
    systemd.receive_until("FDSTOREREMOVE saved")
    assert "fuse" not in systemd.store


def test_a_unit_stop_unmounts(unit, tree):
    unit.start()
    with open(os.path.join(unit.mp, "big.bin"), "rb") as f:
        assert f.read() == (tree / "big.bin").read_bytes()
    # systemctl stop: every process of the unit gets KillSignal= (SIGTERM)
    server = serving(unit.mp)
    unit.procs[0].send_signal(signal.SIGTERM)
    os.kill(server, signal.SIGTERM)
    assert unit.procs[0].wait(WAIT) == 0
    unit.systemd.receive_until("FDSTOREREMOVE saved")
    assert "fuse" not in unit.systemd.store
    unit.systemd.release()  # the unit is dead: systemd lets go of what is left
    assert not is_mounted(unit.mp), "a stopped unit left its mount behind"
    assert os.listdir(unit.mp) == []  # the mount point itself, not a dead mount


def test_a_dead_keeper_leaves_the_mount_to_the_store(unit):
    """The keeper (the unit's main process) killed: systemd signals what is
    left of the unit with SIGTERM before Restart= starts it again. The server
    must not unmount then: the store holds the connection for the next start.
    (The SIGTERM is sent first here, so the server cannot dodge it by seeing
    its keeper gone.)"""
    unit.start()
    unit.read()
    time.sleep(0.5)
    server = serving(unit.mp)
    # the server leaves systemd's signals to its keeper, and serves on
    os.kill(server, signal.SIGTERM)
    time.sleep(1.0)
    assert os.path.exists(f"/proc/{server}") and is_mounted(unit.mp)
    unit.procs[0].kill()
    unit.procs[0].wait(WAIT)
    deadline = time.monotonic() + WAIT
    while os.path.exists(f"/proc/{server}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert is_mounted(unit.mp)
    unit.next_start_takes_over()
    assert fsclient("umount", unit.mp).returncode == 0
