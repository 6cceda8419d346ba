"""A keeper's control socket: where `fsclient restart`, `fsclient mount` on a
kept mount point and the CSI plugin ask the keeper of a mount point for
`restart`, `status` or `surrender` (`desk.ControlDesk`). One request per
connection, each a `handoff` message; the answer likewise.

Naming: an abstract socket (no file to leave behind) named by a digest of
the absolute mount point, so its length does not grow with the path (a
kubelet's targets are 130+ bytes; sun_path holds 107).

Trust, both ways, by SO_PEERCRED (the kernel's word, not the peer's):
- the keeper answers root and its own uid only (`desk`);
- the asker acts only on a keeper that is root or its own uid, and, given
  `expect_pid`, that pid (or one of another uid that the mount itself names
  as its keeper: `check`); it checks before it sends anything, so a
  squatter on the name is asked nothing and handed nothing (`Impostor`;
  `Unvouched` if the mount that could vouch for it did not answer).

`surrender` answers with the connection itself: {"ok": ..., "fuse": n} and
the n /dev/fuse descriptors, then the saved-state memfd. The asker keeps the
control connection open and passes it on to the keeper that takes over (as
`fdstore.PREDECESSOR_NAME`), which sends {"op": "ack"} on it when ready.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import threading
from typing import Any, NamedTuple

from ..mountpoint import MountError
from . import handoff
from .fdstore import FUSE_NAME, PREDECESSOR_NAME, SAVED_NAME

# The name before the digest: keepers of earlier versions named their socket
# by the mount point itself; asks fall back to that name (an upgrade).
_PREFIX = "\0fsclient-keeper:"
_SUN_PATH_MAX = 107
MOUNT_TIMEOUT = 5.0  # the mount's time to name its keeper (`mount_keeper`)


class Impostor(OSError, MountError):
    """The control name of a mount point is held by a process this asker does
    not trust (another uid, or not the pid it expected). Nothing was asked of
    it, and nothing it sent is kept."""


class Unvouched(Impostor):
    """The control name is held by a keeper of another uid that only the mount
    can vouch for (`check`), and the mount did not answer in time: a server's
    successor on a slow mount, or a squatter on a hung one. Nothing was asked
    of it; asking again may find it vouched for."""


class Peer(NamedTuple):
    """Who is at the other end of a unix socket (SO_PEERCRED)."""
    pid: int
    uid: int
    gid: int


def peer(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", raw))


def control_address(mountpoint: str) -> str:
    """The keeper's control socket: abstract, named by a digest of the
    absolute mount point (any length of path fits)."""
    return _PREFIX + hashlib.sha256(os.fsencode(mountpoint)).hexdigest()


def _legacy_address(mountpoint: str) -> str | None:
    name = _PREFIX + mountpoint
    return name if len(os.fsencode(name)) <= _SUN_PATH_MAX else None


def listen(mountpoint: str) -> socket.socket | None:
    """The control socket, or None if another process holds this mount point's
    (`holder` says who)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.bind(control_address(mountpoint))
    except OSError:
        sock.close()
        return None
    sock.listen(8)
    return sock


def holder(mountpoint: str) -> Peer | None:
    """Who listens on `mountpoint`'s control name (asked nothing), or None."""
    try:
        sock = _connect(mountpoint, 5.0)
    except OSError:
        return None
    with sock:
        return peer(sock)


def describe_holder(mountpoint: str) -> str:
    """"held by pid P uid U", for errors about a name that is taken."""
    who = holder(mountpoint)
    return f"held by pid {who.pid} uid {who.uid}" if who else "held by a process gone now"


def _connect(mountpoint: str, timeout: float) -> socket.socket:
    """A connection to the control name (or, for a keeper of an earlier
    version, its name by path). OSError if none listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(control_address(mountpoint))
        return sock
    except (ConnectionRefusedError, FileNotFoundError):
        legacy = _legacy_address(mountpoint)
        if legacy is None:
            sock.close()
            raise
        try:
            sock.connect(legacy)
        except BaseException:
            sock.close()
            raise
        return sock
    except BaseException:
        sock.close()
        raise


def check(sock: socket.socket, mountpoint: str, expect_pid: int | None) -> Peer:
    """The keeper at the other end of `sock`, if this process trusts it: root
    or our own uid, and `expect_pid` if given. Else close `sock` and raise
    Impostor. A pid of 0 means the peer is in a pid namespace we cannot see
    (SO_PEERCRED cannot name it): then only its uid is checked.

    One keeper of another uid is trusted: the one the mount itself names
    (`mount_keeper`), which only the server on the mount's connection can
    answer. It is the keeper a server started as its own uid when its keeper
    died (`successor`). A mount that does not answer vouches for nobody, yet
    accuses nobody either: then `Unvouched`."""
    who = peer(sock)
    me = os.getuid()
    trusted = who.uid in (0, me) and (expect_pid is None or who.pid in (0, expect_pid))
    if not trusted and expect_pid is None and who.pid > 0:
        named = mount_keeper(mountpoint)
        if named is None:
            sock.close()
            raise Unvouched(f"the control socket of {mountpoint} is held by pid {who.pid} "
                            f"uid {who.uid}, a keeper only if the mount names it, and the "
                            f"mount did not answer in {MOUNT_TIMEOUT:g} s; nothing was asked "
                            f"of it. Try again once the mount answers")
        trusted = named == who.pid
    if trusted:
        return who
    sock.close()
    expected = f"root or uid {me}" + (f", pid {expect_pid}" if expect_pid is not None else "")
    holder = (f"pid {who.pid} uid {who.uid}" if who.pid else
              f"uid {who.uid} in a pid namespace this process cannot see")
    find = (f"ps -p {who.pid}" if who.pid else f"ps -u {who.uid} on the host")
    raise Impostor(f"the control socket of {mountpoint} is held by {holder}, not by a "
                   f"keeper this process trusts ({expected}); nothing was asked of it. "
                   f"Find what that process is ({find}), stop it, then mount "
                   f"{mountpoint} again")


class _Probe:
    """One read of the keeper a mount names, on a thread of its own (a hung
    mount holds the thread in the kernel until the mount answers or dies)."""

    def __init__(self, mountpoint: str):
        self.keeper = 0
        self.thread = threading.Thread(target=self._read, args=(mountpoint,),
                                       name="mount-keeper", daemon=True)
        self.thread.start()

    def _read(self, mountpoint: str) -> None:
        try:
            stats = json.loads(os.getxattr(mountpoint, "user.blockcache.stats"))
            self.keeper = int(stats["fsclient"]["keeper"])
        except (OSError, ValueError, KeyError, TypeError):
            pass


_probes: dict[str, _Probe] = {}  # mount point -> the probe under way
_probes_lock = threading.Lock()


def mount_keeper(mountpoint: str, timeout: float = MOUNT_TIMEOUT) -> int | None:
    """The pid of the keeper that the server of the mount on `mountpoint`
    says handed it the connection (the root's `user.blockcache.stats`,
    answered through the kernel); 0 if it names none (or is not a live
    mount); None if it does not answer in `timeout`. Asks while one is
    under way wait for that one: a hung mount, asked again and again,
    holds one thread."""
    with _probes_lock:
        probe = _probes.get(mountpoint)
        if probe is None or not probe.thread.is_alive():  # (a finished one's answer is old)
            probe = _probes[mountpoint] = _Probe(mountpoint)
    probe.thread.join(timeout)
    if probe.thread.is_alive():
        return None
    with _probes_lock:
        if _probes.get(mountpoint) is probe:
            del _probes[mountpoint]
    return probe.keeper


def ask(mountpoint: str, op: str, timeout: float,
        expect_pid: int | None = None) -> dict[str, Any]:
    """Send `op` to the keeper of `mountpoint`; its answer. OSError if none
    listens, Impostor if the one that listens is not trusted (`check`)."""
    sock = _connect(mountpoint, timeout)
    check(sock, mountpoint, expect_pid)
    with sock:
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


def surrender(mountpoint: str, timeout: float, expect_pid: int | None = None) -> Surrendered:
    """Ask the keeper of `mountpoint` for its connection. OSError if none
    listens; Impostor if an untrusted process holds its name (`check`: it is
    asked nothing); ValueError with the keeper's reason if it refuses."""
    sock = _connect(mountpoint, timeout)
    check(sock, mountpoint, expect_pid)
    try:
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
