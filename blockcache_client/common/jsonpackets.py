"""One JSON object per SOCK_SEQPACKET message, descriptors by SCM_RIGHTS:
the framing of fsclient's keeper sockets (keeper and server, its control
socket: `fsclient.keeper.handoff`) and of the CSI plugin's keeper host
(`blockcache_csi.keepers.wire`).

Anyone who can connect may write before the other end checks who it is
(SO_PEERCRED is read after): what is not a JSON object is an {"error"},
its descriptors closed, never an exception that would end the process."""

from __future__ import annotations

import array
import json
import os
import socket
from collections.abc import Sequence
from typing import Any

MAX_FDS = 253  # SCM_MAX_FD


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], rights)


def receive(sock: socket.socket, max_bytes: int) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message (at most `max_bytes`) and the descriptors it carried
    (close-on-exec); (None, []) when the other end has gone (or timed out)."""
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, max_bytes, MAX_FDS,
                                                   socket.MSG_CMSG_CLOEXEC)
    except OSError:
        return None, []
    try:
        message = json.loads(data) if data else None
    except ValueError:
        message = None
    if not isinstance(message, dict):
        for fd in fds:
            os.close(fd)
        if not data:
            return None, []
        return {"error": f"not a message: {len(data)} bytes that are not a JSON object"}, []
    return message, list(fds)
