"""A keeper's control socket: where `fsclient restart`, `fsclient mount` on a
kept mount point and the CSI plugin ask the keeper of a mount point for
`restart`, `status` or `surrender` (`keeper.Keeper._on_control`). One request
per connection, each a `handoff` message; the answer likewise.

`surrender` answers with the connection itself: {"ok": ..., "fuse": n} and
the n /dev/fuse descriptors, then the saved-state memfd. The asker keeps the
control connection open and passes it on to the keeper that takes over (as
`fdstore.PREDECESSOR_NAME`), which sends {"op": "ack"} on it when ready.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import Any

from . import handoff
from .fdstore import FUSE_NAME, PREDECESSOR_NAME, SAVED_NAME


def control_address(mountpoint: str) -> str:
    """The keeper's control socket: abstract (no file to leave behind), named
    by the absolute mount point, or by its hash where the name would not fit
    an AF_UNIX address (107 bytes: a kubelet's target paths are longer)."""
    name = "\0fsclient-keeper:" + mountpoint
    if len(os.fsencode(name)) <= 107:
        return name
    return "\0fsclient-keeper:sha256:" + hashlib.sha256(os.fsencode(mountpoint)).hexdigest()


def listen(mountpoint: str) -> socket.socket | None:
    """The control socket, or None if another keeper holds this mount point's."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.bind(control_address(mountpoint))
    except OSError:
        sock.close()
        return None
    sock.listen(8)
    return sock


def ask(mountpoint: str, op: str, timeout: float) -> dict[str, Any]:
    """Send `op` to the keeper of `mountpoint`; its answer. OSError if none listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        sock.connect(control_address(mountpoint))
        handoff.send(sock, {"op": op})
        message, fds = handoff.receive(sock)
        for fd in fds:
            os.close(fd)
    if message is None:
        raise ConnectionError(f"the keeper of {mountpoint} closed the connection; see its log")
    return message


class Surrendered:
    """A connection a keeper surrendered: its FUSE descriptors, its saved-state
    memfd, and the control connection to that keeper (to pass on for the ack)."""

    def __init__(self, answer: dict[str, Any], sock: socket.socket, fds: list[int]):
        self.answer = answer
        self.sock = sock
        self.fuse_fds = fds[:-1]
        self.saved_fd = fds[-1]

    def named(self) -> list[tuple[str, int]]:
        """(name, fd) for `fdstore.hand_on`."""
        return [*((FUSE_NAME, fd) for fd in self.fuse_fds), (SAVED_NAME, self.saved_fd),
                (PREDECESSOR_NAME, self.sock.fileno())]

    def close(self) -> None:
        """Drop our copies: before an ack, the keeper then serves on."""
        for fd in [*self.fuse_fds, self.saved_fd]:
            os.close(fd)
        self.fuse_fds, self.saved_fd = [], -1
        self.sock.close()


def surrender(mountpoint: str, timeout: float) -> Surrendered:
    """Ask the keeper of `mountpoint` for its connection. OSError if none
    listens; ValueError with the keeper's reason if it refuses."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        sock.connect(control_address(mountpoint))
        handoff.send(sock, {"op": "surrender"})
        message, fds = handoff.receive(sock)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    if message is None or "error" in message or len(fds) != int(message.get("fuse", 0)) + 1:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise ValueError((message or {}).get("error", "the keeper sent no connection"))
    return Surrendered(message, sock, fds)
