"""Under systemd: the keeper keeps the connection in the unit's file descriptor
store, and a restart of the whole unit takes the live mount over from
LISTEN_FDS. A socket here plays systemd's side (NOTIFY_SOCKET, FDSTORE, then
LISTEN_FDS and LISTEN_FDNAMES for the next start); a reader verifies every byte
across the restart."""

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

    def close(self) -> None:
        for fds in self.store.values():
            for fd in fds:
                os.close(fd)
        self.sock.close()


def test_a_unit_restart_keeps_the_mount_through_the_fd_store(tree, key_file, daemon,
                                                             tmp_path):
    mp = str(tmp_path / "mnt")
    os.makedirs(mp)
    argv = [sys.executable, "-m", "fsclient.cli", "--log-level", "debug", "mount", str(tree),
            mp, "--volume", "testvol", "--key-file", str(key_file), "--socket",
            daemon.socket_path, "--meta-ttl", "0", "--foreground"]
    systemd = FakeSystemd(str(tmp_path / "notify.sock"))
    log = str(tmp_path / "unit.log")
    procs: list[subprocess.Popen] = []
    reader = None
    try:
        procs.append(systemd.start(argv, log))
        systemd.receive_until("READY=1")
        assert {"FDSTORE fuse", "FDSTORE saved"} <= set(systemd.states)
        assert len(systemd.store["saved"]) == 1 and systemd.store["fuse"]
        reader = Reader(mp, tree, tmp_path)
        time.sleep(1.0)
        first = procs[0]
        server = serving(mp)
        # systemctl restart (KillMode=control-group): every process of the unit
        # gets SIGTERM, the server too; neither unmounts
        first.send_signal(signal.SIGTERM)
        os.kill(server, signal.SIGTERM)
        assert first.wait(WAIT) == 0
        assert is_mounted(mp)  # kept: systemd holds the connection
        systemd.states.clear()
        # the unit as shipped (Type=forking): `fsclient mount` gets LISTEN_FDS and
        # passes them on to the keeper it starts, then exits 0 once it serves
        procs.append(systemd.start([*argv[:-1], "--log-file", log], log))
        assert procs[1].wait(WAIT) == 0
        systemd.receive_until("READY=1")
        serving(mp)
        time.sleep(1.0)
        tally = reader.finish()
        assert tally["failed"] == {} and tally["wrong"] == 0, tally
        assert tally["ok"] > 50, tally
        assert "taking over" in open(log).read()
        # `fsclient umount` ends the mount; the unit asks systemd to drop the descriptors
        assert fsclient("umount", mp).returncode == 0
        systemd.receive_until("FDSTOREREMOVE saved")
        assert "fuse" not in systemd.store
    finally:
        if reader is not None:
            reader.kill()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        systemd.close()
        force_unmount(mp)
