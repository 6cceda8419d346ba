"""A server whose keeper died starts the next keeper itself.

The keeper holds nothing its server lacks: the server has every /dev/fuse
descriptor of the connection and the saved-state memfd. So when the keeper
dies (kill -9, an OOM kill) and no fd store keeps the connection, the server
starts a new keeper (`fsclient mount ... --foreground`: the command line the
server was started with, less its descriptors) and passes it the connection as a
surrendering keeper would (`fdstore.hand_on`, with a predecessor socket), and
then the volume key's descriptor when that keeper asks for it on the same
socket ({"op": "key"}: once it is not dumpable, so no process of its uid can
take it meanwhile). The server keeps its key descriptor open for this (it
holds the key in memory anyway, and is not dumpable either). It
serves on until the new keeper's server has its volume open and the new
keeper acks, then hands over like a server told to (drains, exits 75); the
new keeper connects its server once this end closes, at the exit, and that
server resends what this one left unanswered. No read fails.

If the new keeper cannot start, exits, or sends no ack within ACK_TIMEOUT,
the server ends the connection as before: a dead mount, which the next
`fsclient mount` there recovers.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import time

from . import handoff
from .fdstore import FUSE_NAME, PREDECESSOR_NAME, SAVED_NAME, hand_on

log = logging.getLogger(__name__)

# Set in the new keeper's environment: ask the predecessor socket for the key.
KEY_FROM_PREDECESSOR = "FSCLIENT_KEY_FROM_PREDECESSOR"
KEY_FLAG = "--key-from-keeper"  # a server's: it asks its keeper for the key
ACK_TIMEOUT = 60.0  # a new keeper's time to start a server that opens its volume
# kept open until this process exits: its end tells the new keeper to go on
_held: list[socket.socket] = []


def without_options(argv: list[str], *names: str, flags: tuple[str, ...] = ()) -> list[str]:
    """`argv` less the options `names` and their values (`--name V`, `--name=V`),
    and the `flags` (options without a value)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            continue
        elif a in names:
            skip = True
        elif not a.startswith(tuple(f"{name}=" for name in names)):
            out.append(a)
    return out


def keeper_command(argv: list[str]) -> list[str]:
    """The keeper's command line, from its server's arguments (`argv`, as
    `keeping.server_command` made them): without the server's descriptors
    (the first server's also reports readiness)."""
    return [sys.executable, "-m", "fsclient.cli",
            *without_options(argv, "--serve-fd", "--ready-fd", "--key-fd", flags=(KEY_FLAG,))]


def take_over(argv: list[str], fuse_fds: list[int], saved_fd: int, mountpoint: str,
              key_fd: int | None = None) -> bool:
    """Start a keeper for this server's connection and wait for its ack:
    True once this server is to hand over to it, False if it failed (then
    it is gone). `key_fd`, this server's descriptor of the volume key, is
    sent when the new keeper asks (`key_from_predecessor`): it runs as this
    server's uid, which may not open the key file."""
    ours, theirs = handoff.pair()
    passing = hand_on([*((FUSE_NAME, fd) for fd in fuse_fds), (SAVED_NAME, saved_fd),
                       (PREDECESSOR_NAME, theirs.fileno())])
    if key_fd is not None and passing.env is not None:
        passing.env[KEY_FROM_PREDECESSOR] = "1"
    try:
        proc = subprocess.Popen(keeper_command(argv), stdin=subprocess.DEVNULL,
                                env=passing.env, start_new_session=True, **passing.popen())
    except OSError as exc:
        log.error("cannot start a new keeper for %s: %s", mountpoint, exc)
        ours.close()
        return False
    finally:
        passing.close()
        theirs.close()
    log.warning("the keeper of %s is gone; started keeper %d to take the mount over",
                mountpoint, proc.pid)
    if _acked(ours, proc, ACK_TIMEOUT, key_fd):
        _held.append(ours)
        return True
    log.error("the new keeper %d of %s did not take it over (%s)", proc.pid, mountpoint,
              f"exit code {proc.returncode}" if proc.poll() is not None else "no ack")
    proc.kill()
    proc.wait()
    ours.close()
    return False


def _acked(sock: socket.socket, proc: subprocess.Popen, timeout: float,
           key_fd: int | None) -> bool:
    """Wait for the new keeper's ack, sending it the key when it asks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], 0.5)
        if ready:
            message, fds = handoff.receive(sock)
            for fd in fds:
                os.close(fd)
            if message is not None and message.get("op") == "key" and key_fd is not None:
                handoff.send(sock, {"key": True}, [key_fd])
                continue
            return message is not None and message.get("op") == "ack"
        if proc.poll() is not None:
            return False
    return False


def key_from_predecessor(predecessor: int, timeout: float = 30.0) -> int:
    """In the keeper a server started (KEY_FROM_PREDECESSOR set): ask that
    server for the volume key's descriptor on the `predecessor` socket;
    OSError if it sends none."""
    with socket.socket(fileno=os.dup(predecessor)) as sock:
        sock.settimeout(timeout)
        handoff.send(sock, {"op": "key"})
        message, fds = handoff.receive(sock)
    if message is None or not message.get("key") or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError("the server that started this keeper sent no volume key")
    return fds[0]
