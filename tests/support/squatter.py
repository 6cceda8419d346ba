"""A squatter on a mount point's keeper control name: a process of another
uid that holds the name and answers every request as a keeper would, naming
a victim pid as the keeper and handing a /dev/fuse descriptor of its own to
`surrender`. What it was asked is reported on a pipe. For the tests that
show an asker trusts no such peer and signals nothing it names."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from fsclient.keeper import control, handoff

WAIT = 60.0


def _squat(mountpoint: str, victim: int, fuse: int, report: int) -> None:
    """As the squatter: hold `mountpoint`'s control name and answer every
    request as a keeper of pid `victim` would, `surrender` with the /dev/fuse
    descriptor `fuse`; each request it gets is written to `report`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(control.control_address(mountpoint))
    sock.listen(8)
    os.write(report, b"listening\n")
    saved = os.memfd_create("saved")
    status = {"ok": True, "keeper": victim, "server": victim, "serving": True,
              "restarts": 0, "mountpoint": mountpoint}
    while True:
        conn, _ = sock.accept()
        message, _fds = handoff.receive(conn)
        os.write(report, json.dumps(message).encode() + b"\n")
        try:
            if (message or {}).get("op") == "surrender":
                handoff.send(conn, {**status, "fuse": 1}, [fuse, saved])
            else:
                handoff.send(conn, status)
        except OSError:
            pass
        conn.close()


def reported(r: int, timeout: float) -> bytes:
    """What the squatter wrote to its report pipe within `timeout`."""
    out = b""
    while select.select([r], [], [], timeout)[0]:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        out += chunk
        timeout = 0.0
    return out


@dataclass
class Squatter:
    pid: int
    uid: int
    victim: subprocess.Popen
    report: int

    @property
    def holder(self) -> str:
        """How an asker names it: "pid P uid U"."""
        return f"pid {self.pid} uid {self.uid}"

    def asked(self, timeout: float = 0.5) -> list[bytes]:
        """The requests it got since the last look (b"null": connected, asked nothing)."""
        return reported(self.report, timeout).splitlines()

    def harmless(self) -> bool:
        """Nothing it named was signalled, and it still runs."""
        return self.victim.poll() is None and os.waitpid(self.pid, os.WNOHANG) == (0, 0)


@contextmanager
def squatting(mountpoint: str, uid: int) -> Iterator[Squatter]:
    """A squatter of `uid` on `mountpoint`'s control name, naming a `sleep`
    as its keeper; both are killed at the end, whatever happened."""
    r, w = os.pipe()
    victim = subprocess.Popen(["sleep", "300"])
    pid = os.fork()
    if pid == 0:  # the squatter: never returns into pytest
        try:
            os.close(r)
            fuse = os.open("/dev/fuse", os.O_RDWR)  # (root's to open here: kept across the drop)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            _squat(mountpoint, victim.pid, fuse, w)
        finally:
            os._exit(1)
    os.close(w)
    try:
        assert reported(r, WAIT) == b"listening\n"
        yield Squatter(pid, uid, victim, r)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        victim.kill()
        victim.wait()
        os.close(r)
