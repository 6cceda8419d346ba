"""The asking side of the keeper host's socket (`wire` has the messages), as
the plugin asks it and as a new host asks the one it replaces."""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any

from . import wire

SURRENDER_ASK_TIMEOUT = 45.0  # the host's wait for a keeper (30 s) and a margin
SPAWN_TIMEOUT = 150.0  # fsclient's readiness bound (90 s) and a margin
STOP_TIMEOUT = 45.0  # three waits of 10 s (end, SIGTERM, SIGKILL) and a margin
ASK_TIMEOUT = 15.0
REPLACED_RETRY = 60.0  # a host being replaced sends us to its successor for this long


class HostUnavailable(OSError):
    """No keeper host answers on the socket."""


class HostError(Exception):
    """The keeper host refused or failed a request; the message says why.
    `refusal`: why a `surrender` was refused (`takeover.REFUSALS`), if it was."""

    def __init__(self, message: str, refusal: str | None = None):
        super().__init__(message)
        self.refusal = refusal


class KeeperHost:
    """The keeper host at `path` (`blockcache-csi keepers --socket`)."""

    def __init__(self, path: str):
        self.path = path

    def _ask(self, message: dict[str, Any], timeout: float, fds: Sequence[int] = ()
             ) -> tuple[list[dict[str, Any]], list[int]]:
        """Every answer to one request, up to the last ({"ok"}, {"error"} or
        {"pid"}, {"alive"}), and the descriptors that came with the last; a
        host being replaced is asked again."""
        deadline = time.monotonic() + REPLACED_RETRY
        while True:
            answers, got = self._once(message, timeout, fds)
            last = answers[-1]
            if not last.get("replaced") or time.monotonic() > deadline:
                break
            wire.close_all(got)
            time.sleep(0.1)  # its successor is renaming its socket over this one
        if "error" in last:
            wire.close_all(got)
            raise HostError(last["error"], last.get("refusal"))
        return answers, got

    def _once(self, message: dict[str, Any], timeout: float, fds: Sequence[int]
              ) -> tuple[list[dict[str, Any]], list[int]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
            s.settimeout(timeout)
            try:
                s.connect(self.path)
                wire.require_root(s, f"the keeper host at {self.path}")
                wire.send(s, message, fds)
                answers = []
                while True:
                    answer, got = wire.receive(s)
                    if answer is None:
                        raise ConnectionError("it closed the connection; see its log")
                    answers.append(answer)
                    if "keeper" not in answer:
                        return answers, got
                    wire.close_all(got)
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
        return int(self._last(message, SPAWN_TIMEOUT, [fd for _, fd in named])["pid"])

    def surrender(self, mountpoint: str) -> list[tuple[str, int]]:
        """The connection of `mountpoint`'s keeper, which the host asked for:
        (name, fd) pairs to pass to `spawn`, ours to close. HostError with a
        `refusal` if the keeper would not or could not hand it over."""
        answers, got = self._ask({"op": "surrender", "mountpoint": mountpoint},
                                 SURRENDER_ASK_TIMEOUT)
        names = answers[-1].get("fds")
        if not (isinstance(names, list) and len(names) == len(got)
                and all(isinstance(n, str) for n in names)):
            wire.close_all(got)
            raise HostError(f"the keeper host sent {len(got)} descriptors for {names!r}")
        return list(zip(names, got))

    def stop(self, pid: int) -> str:
        return str(self._last({"op": "stop", "pid": pid}, STOP_TIMEOUT)["ended"])

    def alive(self, pid: int) -> bool:
        return bool(self._last({"op": "alive", "pid": pid}, ASK_TIMEOUT)["alive"])

    def list(self) -> list[dict[str, Any]]:
        """[{pid, mountpoint, source, argv, env, ready}] of every keeper it started
        (pid 0 and not ready: still starting)."""
        answers, got = self._ask({"op": "list"}, ASK_TIMEOUT)
        wire.close_all(got)
        return [a["keeper"] for a in answers[:-1]]

    def _last(self, message: dict[str, Any], timeout: float, fds: Sequence[int] = ()
              ) -> dict[str, Any]:
        """The last answer to a request that sends no descriptors back."""
        answers, got = self._ask(message, timeout, fds)
        wire.close_all(got)
        return answers[-1]

    def keeper_of(self, mountpoint: str) -> int | None:
        """The pid of the host's ready keeper of `mountpoint`, if there is one."""
        return next((k["pid"] for k in self.list()
                     if k["mountpoint"] == mountpoint and k["ready"]), None)
