"""Whoever answers on the socket must be the daemon.

Its uid (SO_PEERCRED) must be root's or `daemon_uid` (default
$BLOCKCACHE_DAEMON_UID, else the owner of the socket's directory, which only
that owner and root can create sockets in). Anyone else is treated as no
daemon (`UntrustedPeer`, a `DaemonUnavailable`): a process that took the
socket path could otherwise hand readers a layout of its own and take their
fills.
"""

from __future__ import annotations

import os
import socket
import struct

from ..contract.errors import ConfigError, UntrustedPeer

DAEMON_UID_ENV = "BLOCKCACHE_DAEMON_UID"
_PEERCRED = struct.Struct("3i")


def configured_daemon_uid(daemon_uid: int | None = None) -> int | None:
    """The uid the daemon is expected to run as: `daemon_uid`, else
    $BLOCKCACHE_DAEMON_UID, else None (the owner of the socket's dir)."""
    if daemon_uid is None:
        text = os.environ.get(DAEMON_UID_ENV, "").strip()
        if not text:
            return None
        try:
            daemon_uid = int(text)
        except ValueError:
            raise ConfigError(f"${DAEMON_UID_ENV}={text!r} is not a uid; set it to the "
                              f"numeric uid blockcached runs as, or unset it") from None
    if isinstance(daemon_uid, bool) or not isinstance(daemon_uid, int) or daemon_uid < 0:
        raise ConfigError(f"daemon_uid {daemon_uid!r} must be a uid (an integer >= 0)")
    return daemon_uid


def check_peer(sock: socket.socket, socket_path: str, daemon_uid: int | None) -> int:
    """The uid of the process answering on `sock`; DaemonUnavailable if it
    is neither root nor the expected daemon uid (see the module docstring)."""
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                 _PEERCRED.size))
    if uid == 0 or uid == daemon_uid:
        return uid
    where = os.path.dirname(os.path.abspath(socket_path))
    if daemon_uid is None:
        try:
            owner = os.stat(where).st_uid
        except OSError:
            owner = None
        if uid == owner:
            return uid
        expected = f"root or uid {owner}, the owner of {where}"
    else:
        expected = f"root or uid {daemon_uid} (daemon_uid / ${DAEMON_UID_ENV})"
    raise UntrustedPeer(f"the process answering on {socket_path} runs as uid {uid}, but "
                            f"blockcached is expected to run as {expected}; treating it as "
                            f"no daemon. If uid {uid} really is your blockcached, set "
                            f"${DAEMON_UID_ENV}={uid}")
