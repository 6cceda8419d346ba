"""Helpers for keeper tests: find the serving server, kill it (or the whole
mount), keep a keeper busy, and a verifying reader (devtools.mountreader) in
its own process."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import subprocess
import sys
import threading

from devtools import mountreader
from fsclient import keeper as keeping
from tests.support.fsclient_mounts import REPO, env
from tests.support.proc_files import children_of, wait_dead
from tests.support.waiting import wait_for

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


def keeper_status(target: str) -> dict:
    return keeping.status(target)


def pids(target: str) -> tuple[int, int]:
    """(keeper, server) of the mount on `target`."""
    st = keeping.status(target)
    return st["keeper"], st["server"]


def wait_new_server(target: str, other_than: int, timeout: float = 30.0) -> int:
    """The pid of a serving server of `target` other than `other_than`."""
    box: list[int] = []

    def serving() -> bool:
        try:
            st = keeping.status(target)
        except Exception:
            return False
        if st["serving"] and st["server"] != other_than:
            box.append(st["server"])
            return True
        return False

    wait_for(serving, timeout, f"a new server on {target}")
    return box[-1]


def kill_mount(target: str) -> dict:
    """Kill `target`'s keeper and server together (stopped first, so neither
    starts the other again): the mount is dead (ENOTCONN). Their status."""
    st = keeping.status(target)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in (st["keeper"], st["server"]):
            os.kill(pid, sig)
    wait_dead(st["keeper"])
    try:
        os.listdir(target)
    except OSError as exc:
        assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED), exc
    else:
        raise AssertionError(f"{target} still answers after its keeper and server died")
    return st


def keepers_under(host_pid: int) -> dict[str, int]:
    """{target: keeper pid} of the keepers whose parent is `host_pid` (pids as
    we see them: the host may be PID 1 of a namespace of its own)."""
    out = {}
    for pid in children_of(host_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "fsclient.cli" in argv and "mount" in argv and "--serve-fd" not in argv:
            out[argv[argv.index("mount") + 2]] = pid
    return out


class Busy:
    """A keeper busy with a restart (so it refuses to surrender) until `release`:
    `fsclient restart` of `target`, with the new server stopped (SIGSTOP)
    before it asks for the connection. `keeper`: its pid as we see it."""

    def __init__(self, target: str, keeper: int):
        self.target, self.keeper = target, keeper
        serving = set(children_of(keeper))  # (pids as we see them, whatever its namespace)
        self.result: list = []
        self.thread = threading.Thread(target=self._restart, daemon=True)
        self.thread.start()
        box: list[int] = []

        def new_server() -> bool:
            box[:] = [p for p in children_of(keeper) if p not in serving]
            return bool(box)

        wait_for(new_server, 10, f"the restart's server under keeper {keeper}")
        self.stopped = box[0]
        os.kill(self.stopped, signal.SIGSTOP)

    def _restart(self) -> None:
        try:
            self.result.append(keeping.restart(self.target, 60))
        except Exception as exc:  # reported by `release`
            self.result.append(exc)

    def refuses(self) -> bool:
        from fsclient.keeper import surrender

        try:
            surrender(self.target, 10).close()  # (never acked: it serves on)
        except ValueError:
            return True
        return False

    def release(self) -> dict:
        os.kill(self.stopped, signal.SIGCONT)
        self.thread.join(90)
        assert self.result and isinstance(self.result[0], dict), self.result
        return self.result[0]
