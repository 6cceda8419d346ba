"""The keepers a host has started: each one's start (`fsclient mount ...
--foreground`, detached in its own session, in a cgroup of its own), its
readiness, its stop, and the reaping of every child and orphan.

One thread reaps (`reap`, from the host's loop): `waitpid(-1)`, so the
orphans that reach the host (as PID 1 of its container, or as a subreaper)
are collected too. A child is started and entered in the table under the
same lock the reaper takes, so no exit is collected before its child is known.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fsclient import mountpoint as mp
from fsclient.keeper import hand_on

from .cgroups import KeeperCgroups, join

log = logging.getLogger(__name__)

READY_TIMEOUT = 90.0  # fsclient's own bound for a mount to answer
STOP_TIMEOUT = 10.0  # a keeper's time to end on its own (its mount is gone), then after SIGTERM


@dataclass
class Child:
    """One keeper this host started."""
    mountpoint: str
    source: str
    argv: list[str]
    env: dict[str, str]
    pid: int = 0
    ready: bool = False
    cgroup: str | None = None
    code: int | None = None  # its exit status, once reaped
    proc: subprocess.Popen | None = None  # held: a dropped Popen would reap it on its own
    ended: threading.Event = field(default_factory=threading.Event)
    stopping: bool = False  # asked to end (`Children.stop`): not lost when it does

    def describe(self) -> dict[str, Any]:
        return {"pid": self.pid, "mountpoint": self.mountpoint, "source": self.source,
                "argv": self.argv, "env": self.env, "ready": self.ready and self.running()}

    def running(self) -> bool:
        """Started and not ended, whether reaped yet or not: a keeper killed a
        moment ago waits for the reaper's next turn, and one that is listed
        as serving meanwhile has a plugin starting then take its dead mount
        for kept. (WNOWAIT: looked at, left for the reaper.)"""
        if not self.pid or self.code is not None:
            return False
        try:
            return os.waitid(os.P_PID, self.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:  # reaped meanwhile
            return False


class SpawnError(Exception):
    """A keeper that did not become ready; the message says why."""


def _preexec(cgroup: str | None, then: Any) -> None:
    join(cgroup)
    if then is not None:
        then()


class Children:
    """The keepers of this host, by pid, and those still starting."""

    def __init__(self, cgroups: KeeperCgroups,
                 on_lost: Callable[[Child], None] | None = None):
        self.cgroups = cgroups
        self.on_lost = on_lost  # called (from the reaper) for a keeper `lost`
        self._lock = threading.Lock()
        self._by_pid: dict[int, Child] = {}
        self._starting: list[Child] = []
        self._ended_cgroups: set[str] = set()  # of ended keepers, until empty

    # what the host answers

    def listing(self) -> list[dict[str, Any]]:
        with self._lock:
            return [c.describe() for c in (*self._by_pid.values(), *self._starting)]

    def get(self, pid: int) -> Child | None:
        with self._lock:
            return self._by_pid.get(pid)

    def serving(self, mountpoint: str) -> Child | None:
        with self._lock:
            return next((c for c in self._by_pid.values() if c.mountpoint == mountpoint
                         and c.ready and c.running()), None)

    def has(self, mountpoint: str) -> bool:
        """Whether a keeper of ours serves `mountpoint`, or is starting to."""
        with self._lock:
            return any(c.mountpoint == mountpoint
                       for c in (*self._by_pid.values(), *self._starting))

    @staticmethod
    def lost(child: Child) -> bool:
        """Whether `child`, now ended, may have left its mount behind unasked:
        killed by a signal (a keeper that surrendered, or whose mount ended,
        exits with a code) while serving, not stopped by us. Its server then
        starts the next keeper itself (fsclient's successor); `retake` looks
        whether the mount is still there."""
        return (child.ready and not child.stopping and child.code is not None
                and child.code < 0)

    def register(self, child: Child) -> None:
        """Enter a keeper about to start, so `list` shows it from now on."""
        with self._lock:
            self._starting.append(child)

    def forget(self, child: Child) -> None:
        with self._lock:
            if child in self._starting:
                self._starting.remove(child)

    # start

    def spawn(self, child: Child, named: Sequence[tuple[str, int]] = ()) -> None:
        """Start `child` (registered) and wait until its mount answers; SpawnError
        (and nothing left running or mounted by it) if it does not."""
        premounted = mp.is_mounted(child.mountpoint)
        passing = hand_on(named, env=child.env) if named else None
        r, w = os.pipe()
        if passing is not None:  # (this host's low fds may be free: 3.. is where named go)
            w = passing.clear(w)
        cmd = [sys.executable, "-m", "fsclient.cli", *child.argv, "--foreground",
               "--ready-fd", str(w)]
        child.cgroup = self.cgroups.make()
        if passing is not None:
            kw = passing.popen(w)
            kw["preexec_fn"] = partial(_preexec, child.cgroup, kw.get("preexec_fn"))
            env = passing.env
        else:
            kw = {"pass_fds": (w,), "close_fds": True,
                  "preexec_fn": partial(_preexec, child.cgroup, None)}
            env = child.env
        try:
            with self._lock:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=2, env=env,
                                        start_new_session=True, **kw)
                child.pid, child.proc = proc.pid, proc
                self._starting.remove(child)
                self._by_pid[proc.pid] = child
        except (OSError, subprocess.SubprocessError) as exc:
            os.close(r)
            self.forget(child)
            self.cgroups.remove(child.cgroup)
            raise SpawnError(f"cannot start a keeper: {exc}") from None
        finally:
            os.close(w)
            if passing is not None:
                passing.close()
        try:
            kind, message = _await_ready(r, READY_TIMEOUT)
        finally:
            os.close(r)
        if kind == "READY":
            child.ready = True
            log.info("keeper %d serves %s", child.pid, child.mountpoint)
            return
        self._discard(child, premounted)
        if kind == "ERROR":
            raise SpawnError(message)
        if kind == "TIMEOUT":
            raise SpawnError(f"the mount of {child.mountpoint} did not become ready within "
                             f"{READY_TIMEOUT:g}s; see the keeper host's log")
        raise SpawnError(f"the keeper exited ({_describe(child.code)}) before "
                         f"{child.mountpoint} was ready; see the keeper host's log")

    def _discard(self, child: Child, premounted: bool) -> None:
        """A keeper that failed: gone, and nothing of it left mounted."""
        if not child.ended.wait(10.0):
            self._signal(child, signal.SIGKILL)
            child.ended.wait(10.0)
        try:
            if not premounted and mp.is_mounted(child.mountpoint):
                mp.unmount(mp.absolute(child.mountpoint), lazy=True)
        except mp.MountError as exc:
            log.warning("%s", exc)

    # stop

    def stop(self, child: Child) -> str:
        """Wait for `child` to end (its mount is gone, so it ends on its own);
        SIGTERM, then SIGKILL, after STOP_TIMEOUT each. How it ended."""
        child.stopping = True
        for how, sig in (("ended", None), ("terminated", signal.SIGTERM),
                         ("killed", signal.SIGKILL)):
            if sig is not None:
                self._signal(child, sig)
            if child.ended.wait(STOP_TIMEOUT):
                return how
            log.warning("keeper %d of %s has not ended within %gs", child.pid,
                        child.mountpoint, STOP_TIMEOUT)
        return "not ended"

    def _signal(self, child: Child, sig: int) -> None:
        with self._lock:  # (never a pid the reaper has just freed)
            if child.code is None and child.pid:
                try:
                    os.kill(child.pid, sig)
                except ProcessLookupError:
                    pass

    # reaping

    def reap(self) -> None:
        """Collect every child and orphan that has ended."""
        while True:
            with self._lock:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                child = self._by_pid.pop(pid, None)
                if child is not None:
                    child.code = os.waitstatus_to_exitcode(status)
                    if child.proc is not None:
                        child.proc.returncode = child.code
            if child is not None:
                child.ended.set()
                log.info("keeper %d of %s ended (%s)", pid, child.mountpoint,
                         _describe(child.code))
                if child.cgroup is not None:
                    self._ended_cgroups.add(child.cgroup)
                if self.on_lost is not None and self.lost(child):
                    self.on_lost(child)
        if self._ended_cgroups:
            self.cgroups.sweep(self._ended_cgroups)
            self._ended_cgroups &= self.cgroups.made()


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _await_ready(r: int, timeout: float) -> tuple[str, str]:
    """The keeper's readiness line (fsclient.mount's protocol): READY or ERROR
    with its message, EOF (it died), or TIMEOUT."""
    deadline = time.monotonic() + timeout
    pending = b""
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([r], [], [], min(left, 1.0))[0]:
            continue
        chunk = os.read(r, 4096)
        if not chunk:
            return "EOF", ""
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            kind, _, message = line.decode("utf-8", "replace").partition(" ")
            if kind == "WARN":
                log.warning("%s", message)
            elif kind in ("READY", "ERROR"):
                return kind, message
    return "TIMEOUT", ""
