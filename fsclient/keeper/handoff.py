"""The keeper and its server talk over one SOCK_SEQPACKET socket pair (one
message per send, descriptors by SCM_RIGHTS). Every message is JSON:

    server -> keeper  {"op": "key"}         (first, once it is not dumpable) the volume key
    keeper -> server  {"key": true} + its descriptor, or {"error": "..."}
    server -> keeper  {"op": "connect"}     the volume is open: hand me the connection
    keeper -> server  {"fresh": bool, "restarts": n, "keeper": pid, "stored": bool,
                       "root": bool}
                      + the saved-state memfd, the mount root's O_PATH descriptor
                      (if "root"), then one /dev/fuse descriptor per worker
                      or {"error": "..."} and no descriptors (the mount failed)
    server -> keeper  {"op": "serving"}     the mount answers (first start: READY sent)
    keeper -> server  {"op": "handover"}    stop taking requests, finish, exit 75 (upgrade)
    keeper -> server  {"op": "unmount"}     end the mount, as SIGTERM would (a stopped
                                            unit, whose server ignores signals: `stored`)

The socket's end is the other side's death: the server learns that its keeper is
gone (EOF), the keeper learns it by waiting on the server's pid.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from blockcache_client.common import jsonpackets as packets

# A server's exit code after a handover: it left the mount to a successor
# (EX_TEMPFAIL; 0 means the mount has ended).
HANDED_OVER = 75
# What systemd sends the unit's processes on a restart (RestartKillSignal= in
# fsclient@.service), where a stop sends SIGTERM: the mount stays in its fd store.
RESTART_SIGNAL = signal.SIGUSR2
MAX_MESSAGE = 64 << 10


def pair() -> tuple[socket.socket, socket.socket]:
    """(keeper's end, server's end); the server's end is inheritable."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.set_inheritable(True)
    return ours, theirs


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    packets.send(sock, message, fds)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors it carried; (None, []) when the
    other side is gone; {"error"} for what is no message (`jsonpackets`:
    any uid may write to a control socket before it is checked)."""
    return packets.receive(sock, MAX_MESSAGE)


class Connection:
    """What a server gets from its keeper."""

    def __init__(self, message: dict[str, Any], fds: list[int]):
        self.fresh = bool(message["fresh"])
        self.restarts = int(message.get("restarts", 0))
        self.keeper = int(message.get("keeper", 0))
        # systemd keeps the connection: the signals systemd sends every process
        # of the unit are the keeper's to act on (it tells this server by
        # "handover" or "unmount"); a server whose keeper died must not unmount
        self.stored = bool(message.get("stored", False))
        self.saved_fd = fds[0]
        # the mount's root (O_PATH) for the readiness probe, which needs no path
        # search then; closed after it (it keeps the mount busy): `close_root`
        self.root_fd = fds[1] if message.get("root") else -1
        self.fuse_fds = fds[2:] if message.get("root") else fds[1:]

    def close_root(self) -> None:
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    def close(self) -> None:
        self.close_root()
        for fd in [self.saved_fd, *self.fuse_fds]:
            os.close(fd)


class KeeperLink:
    """The server's end of the socket to its keeper."""

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self.sock.set_inheritable(False)

    def key(self) -> int:
        """A descriptor of the volume key, which the keeper opened (the server
        may not open the file); OSError with the keeper's reason."""
        send(self.sock, {"op": "key"})
        message, fds = receive(self.sock)
        if message is None:
            raise ConnectionError("the keeper is gone")
        if "error" in message or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(message.get("error", "the keeper sent no key"))
        return fds[0]

    def connect(self) -> Connection:
        """The mount's connection; OSError with the keeper's reason if it has none."""
        send(self.sock, {"op": "connect"})
        message, fds = receive(self.sock)
        if message is None:
            raise ConnectionError("the keeper is gone")
        if "error" in message or len(fds) < 2 + bool(message.get("root")):
            for fd in fds:
                os.close(fd)
            raise OSError(message.get("error", "the keeper sent no FUSE descriptor"))
        return Connection(message, fds)

    def serving(self) -> None:
        send(self.sock, {"op": "serving"})

    def watch(self, on_handover: Callable[[], None], on_unmount: Callable[[], None],
              on_lost: Callable[[], None]) -> None:
        """Call `on_handover` or `on_unmount` when the keeper asks for it,
        `on_lost` when it is gone (on a thread of its own)."""

        def run() -> None:
            while True:
                message, fds = receive(self.sock)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    on_lost()
                    return
                if message.get("op") == "handover":
                    on_handover()
                elif message.get("op") == "unmount":
                    on_unmount()

        threading.Thread(target=run, name="keeper-link", daemon=True).start()
