"""The keeper host's socket: one SOCK_SEQPACKET connection per request, each
message one JSON object, descriptors by SCM_RIGHTS (as a keeper's control
socket speaks, `fsclient.keeper.control`).

    -> {"op": "spawn", "argv": [...], "env": {...}, "mountpoint": M,
        "source": S, "fds": [name, ...]}  + the named descriptors (optional)
    <- {"pid": P} once the keeper is ready, or {"error": reason}
    -> {"op": "surrender", "mountpoint": M}
    <- {"ok": true, "fds": [name, ...]} + the keeper's surrendered connection
       (to pass to a spawn), or {"error": reason, "refusal": "none"|"busy"|"squatted"}
    -> {"op": "stop", "pid": P}    <- {"ok": true, "ended": how} or {"error": ...}
    -> {"op": "alive", "pid": P}   <- {"alive": bool}
    -> {"op": "list"}              <- {"keeper": {pid, mountpoint, source, argv, env,
                                       ready}} per keeper, then {"ok": true, "count": n}

Both ends check the other's SO_PEERCRED: only uid 0 asks, only uid 0 answers.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

from blockcache_client.common import jsonpackets as packets

MAX_MESSAGE = 1 << 20


class PeerRefused(PermissionError):
    """The other end of a keeper host connection is not root."""


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (as of its connect)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def require_root(sock: socket.socket, what: str) -> None:
    pid, uid = peer_uid(sock)
    if uid != 0:
        raise PeerRefused(f"{what} is pid {pid}, uid {uid}, not root; refused")


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    packets.send(sock, message, fds)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and its descriptors; (None, []) when the other end
    has gone; {"error"} for what is no message (`jsonpackets`)."""
    return packets.receive(sock, MAX_MESSAGE)


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)
