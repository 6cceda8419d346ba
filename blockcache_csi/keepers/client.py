"""The asking side of the keeper host's socket (`wire` has the messages), as
the plugin asks it and as a new host asks the one it replaces."""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any

from . import wire

SPAWN_TIMEOUT = 150.0  # fsclient's readiness bound (90 s) and a margin
STOP_TIMEOUT = 45.0  # three waits of 10 s (end, SIGTERM, SIGKILL) and a margin
ASK_TIMEOUT = 15.0
REPLACED_RETRY = 60.0  # a host being replaced sends us to its successor for this long


class HostUnavailable(OSError):
    """No keeper host answers on the socket."""


class HostError(Exception):
    """The keeper host refused or failed a request; the message says why."""


class KeeperHost:
    """The keeper host at `path` (`blockcache-csi keepers --socket`)."""

    def __init__(self, path: str):
        self.path = path

    def _ask(self, message: dict[str, Any], timeout: float, fds: Sequence[int] = ()
             ) -> list[dict[str, Any]]:
        """Every answer to one request, up to the last ({"ok"}, {"error"} or
        {"pid"}, {"alive"}); a host being replaced is asked again."""
        deadline = time.monotonic() + REPLACED_RETRY
        while True:
            answers = self._once(message, timeout, fds)
            last = answers[-1]
            if not last.get("replaced") or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # its successor is renaming its socket over this one
        if "error" in last:
            raise HostError(last["error"])
        return answers

    def _once(self, message: dict[str, Any], timeout: float, fds: Sequence[int]
              ) -> list[dict[str, Any]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
            s.settimeout(timeout)
            try:
                s.connect(self.path)
                wire.require_root(s, f"the keeper host at {self.path}")
                wire.send(s, message, fds)
                answers = []
                while True:
                    answer, got = wire.receive(s)
                    wire.close_all(got)
                    if answer is None:
                        raise ConnectionError("it closed the connection; see its log")
                    answers.append(answer)
                    if "keeper" not in answer:
                        return answers
            except wire.PeerRefused:
                raise
            except OSError as exc:
                raise HostUnavailable(
                    f"the keeper host at {self.path} did not answer ({exc}); is the "
                    f"blockcache-csi-keepers DaemonSet running on this node?") from None

    def spawn(self, argv: list[str], env: dict[str, str], mountpoint: str, source: str,
              named: Sequence[tuple[str, int]] = ()) -> int:
        """Start a keeper (with a surrendered connection: `named`); its pid, in
        the host's pid namespace, once its mount answers."""
        message = {"op": "spawn", "argv": argv, "env": env, "mountpoint": mountpoint,
                   "source": source, "fds": [name for name, _ in named]}
        return int(self._ask(message, SPAWN_TIMEOUT, [fd for _, fd in named])[-1]["pid"])

    def stop(self, pid: int) -> str:
        return str(self._ask({"op": "stop", "pid": pid}, STOP_TIMEOUT)[-1]["ended"])

    def alive(self, pid: int) -> bool:
        return bool(self._ask({"op": "alive", "pid": pid}, ASK_TIMEOUT)[-1]["alive"])

    def list(self) -> list[dict[str, Any]]:
        """[{pid, mountpoint, source, argv, env, ready}] of every keeper it started
        (pid 0 and not ready: still starting)."""
        return [a["keeper"] for a in self._ask({"op": "list"}, ASK_TIMEOUT)[:-1]]

    def keeper_of(self, mountpoint: str) -> int | None:
        """The pid of the host's ready keeper of `mountpoint`, if there is one."""
        return next((k["pid"] for k in self.list()
                     if k["mountpoint"] == mountpoint and k["ready"]), None)
