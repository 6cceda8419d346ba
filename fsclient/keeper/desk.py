"""The keeper's side of its control socket (`control`): who may ask, and what
each request does (`restart`, `status`, `surrender`).

Only root and the keeper's own (real) uid may ask: the kernel names the asker
(SO_PEERCRED), so a uid with no rights gets an error naming its uid and
nothing else (no status, no connection, no restart), and the keeper logs it.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from . import handoff
from .control import describe_holder, listen, peer

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 5.0  # a trusted asker's time to send its request once connected
STRANGER_TIMEOUT = 0.5  # and a refused one's (its request is read, then refused)


class ControlDesk:
    """Answers the control socket; mixed into `keeper.Keeper`, whose state
    (the connection, the servers, the surrender under way) it reads."""

    mountpoint: str
    fds: list[int]
    saved_fd: int
    server: Any
    successor: Any
    waiters: list[socket.socket]
    terminate: bool
    keeping: bool
    served: bool
    control: socket.socket | None
    predecessor: socket.socket | None
    asker: socket.socket | None
    left_to: socket.socket | None
    restarts: int

    def _spawn(self, ready_fd: int | None = None) -> Any:
        raise NotImplementedError

    def _on_control(self) -> None:
        assert self.control is not None
        try:
            conn, _ = self.control.accept()
        except OSError:
            return
        who = peer(conn)
        trusted = who.uid in (0, os.getuid())
        # a stranger that sends nothing holds this loop for STRANGER_TIMEOUT at most
        conn.settimeout(REQUEST_TIMEOUT if trusted else STRANGER_TIMEOUT)
        message, fds = handoff.receive(conn)
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        op = (message or {}).get("op")
        if not trusted:
            log.warning("keeper %d: refused %r from pid %d uid %d on %s: a control request "
                        "from a uid other than root and %d", os.getpid(), op, who.pid,
                        who.uid, self.mountpoint, os.getuid())
            _answer(conn, {"error": f"uid {who.uid} may not ask this keeper"})
            return
        if op == "restart":
            self.restart(conn)
        elif op == "surrender":
            self.surrender(conn)
        elif op == "status":
            _answer(conn, {"ok": True, **self.status()})
        else:
            _answer(conn, {"error": f"unknown request {op!r}"})

    def status(self) -> dict[str, Any]:
        server = self.server
        return {"keeper": os.getpid(), "server": server.proc.pid if server else None,
                "serving": bool(server and server.serving), "restarts": self.restarts,
                "mountpoint": self.mountpoint}

    def restart(self, caller: socket.socket | None) -> None:
        """Start a successor; `caller` gets {"ok": ...} once it serves."""
        if not self.fds or self.server is None or not self.served:
            if caller is not None:
                _answer(caller, {"error": "the mount is not serving yet; try again"})
            return
        if caller is not None:
            self.waiters.append(caller)
        if self.successor is None:
            self.successor = self._spawn()

    def surrender(self, asker: socket.socket) -> None:
        """Send `asker` the connection; hand the server over once it acks."""
        server = self.server
        if not self.fds or server is None or not server.serving or self.terminate or \
                self.successor is not None or self.asker is not None or \
                self.predecessor is not None:
            _answer(asker, {"error": "the mount is not serving steadily now; try again"})
            return
        handoff.send(asker, {"ok": True, **self.status(), "fuse": len(self.fds)},
                     [*self.fds, self.saved_fd])
        # the taker binds the control socket; we bind it again if the asker leaves
        if self.control is not None:
            self.control.close()
            self.control = None
        self.asker = asker

    def _on_asker(self) -> None:
        assert self.asker is not None
        message, fds = handoff.receive(self.asker)
        for fd in fds:
            os.close(fd)
        if message is None:
            log.warning("keeper %d: the asker of surrender left before its ack; %s is kept "
                        "here as before", os.getpid(), self.mountpoint)
            self.asker.close()
            self.asker = None
            self.control = listen(self.mountpoint)
            if self.control is None:
                log.warning("cannot listen on the control socket of %s again: %s",
                            self.mountpoint, describe_holder(self.mountpoint))
        elif message.get("op") == "ack":
            log.info("keeper %d: surrendered %s; the server hands over", os.getpid(),
                     self.mountpoint)
            self.left_to, self.asker = self.asker, None
            self.terminate = self.keeping = True
            for s in (self.server, self.successor):
                if s is not None and s.proc.poll() is None:
                    if s.connected:
                        handoff.send(s.sock, {"op": "handover"})
                    else:
                        s.proc.kill()


def _answer(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        handoff.send(conn, message)
    except OSError:
        pass  # the asker is gone
    conn.close()
