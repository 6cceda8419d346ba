"""Helpers for keeper tests: find the serving server, kill it, and a verifying
reader (devtools.mountreader) in its own process."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys

from devtools import mountreader
from tests.support.fsclient_mounts import REPO, env

RESUME = 30.0  # a hang bound, not a speed target (bench/ has the stall figures)


def serving(mountpoint: str, other_than: int = 0) -> int:
    """The server pid once a server other than `other_than` serves."""
    return mountreader.serving(mountpoint, other_than, RESUME)


class Reader:
    """devtools.mountreader in its own process; `finish` returns its tally."""

    def __init__(self, mountpoint: str, source: str, tmp_path, cwd: str = "dir0"):
        self.stop = str(tmp_path / "reader.stop")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "devtools.mountreader", mountpoint, str(source), self.stop,
             "--cwd", cwd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(), cwd=REPO)

    def finish(self) -> dict:
        open(self.stop, "w").close()
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err.decode()
        return json.loads(out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def kill_server(mountpoint: str) -> int:
    pid = serving(mountpoint)
    os.kill(pid, signal.SIGKILL)
    return pid


_SYS_PIDFD_GETFD = 438  # x86_64 and aarch64 alike
_LISTENING = 0x10000  # /proc/net/unix Flags: __SO_ACCEPTCON


def copy_fds(pid: int, wanted) -> list[int]:
    """Copies (pidfd_getfd) of the descriptors of `pid` whose link target
    (`/proc/PID/fd/N`) `wanted` accepts, in descriptor order."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    copies = []
    try:
        for name in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
            if wanted(os.readlink(f"/proc/{pid}/fd/{name}")):
                fd = libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(name), 0)
                if fd < 0:
                    raise OSError(ctypes.get_errno(), f"pidfd_getfd of {pid}'s fd {name}")
                copies.append(fd)
    finally:
        os.close(pidfd)
    return copies


def copy_connected_sockets(pid: int) -> list[int]:
    """Copies (pidfd_getfd) of the connected unix sockets `pid` holds, such as a
    keeper's link to its server: while they are open, the server sees no EOF
    when that process dies. Listening sockets are left alone."""
    listening = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if int(fields[3], 16) & _LISTENING:
                listening.add(fields[6])
    return copy_fds(pid, lambda target: target.startswith("socket:[")
                    and target[8:-1] not in listening)


def surrender_to(mountpoint: str, new, timeout: float = 60.0) -> dict:
    """As a new CSI plugin takes a mount over: ask its keeper to surrender, and
    start the keeper `new` (an unstarted FsclientMount) with the connection;
    returns once `new`'s server serves, with the old keeper's answer."""
    from fsclient.keeper import control
    from fsclient.keeper.fdstore import hand_on

    surrendered = control.surrender(mountpoint, timeout)
    passing = hand_on(surrendered.named(), env())
    try:
        new.start(passing)  # READY: the new keeper's server serves
    finally:
        passing.close()
        surrendered.close()
    return surrendered.answer
