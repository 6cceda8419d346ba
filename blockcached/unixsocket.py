"""The daemon's unix socket in the file system and in the kernel: binding it
with its mode and group (never through a symlink, never briefly
world-accessible), and the peer credentials of a connection on it."""

from __future__ import annotations

import os
import socket
import stat
import struct

from .access import Peer
from .config import Config

_PEERCRED = struct.Struct("3i")
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


def bind_socket(cfg: Config) -> socket.socket:
    """A stream socket bound at `cfg.socket` with `cfg.socket_mode` (and
    group), replacing a dead daemon's socket left there."""
    path = cfg.socket
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        # We hold <socket>.lock, so a socket left here is a dead daemon's.
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(f"{path} exists and is not a socket; remove it or choose "
                          f"another --socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # never briefly world-accessible before chmod
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    try:  # never through a symlink that replaced the socket meanwhile
        os.chmod(path, cfg.socket_mode, follow_symlinks=False)
        if cfg.socket_group is not None:
            os.chown(path, -1, cfg.socket_group, follow_symlinks=False)
    except NotImplementedError:  # glibc's answer for a symlink
        raise OSError(f"{path} was replaced by a symlink while the daemon created it; "
                      f"check who can write in {os.path.dirname(path)}") from None
    return sock


def peer_of(sock: socket.socket | None) -> Peer:
    """The peer's pid/uid/gid and supplementary groups, from the kernel."""
    if sock is None:
        return Peer(0, -1, -1)
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     _PEERCRED.size))
    groups: tuple[int, ...] = ()
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 1024)
        groups = struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4])
    except OSError:
        pass  # older kernels: primary gid only
    return Peer(pid, uid, gid, tuple(groups))
