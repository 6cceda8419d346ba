"""systemd's file descriptor store: where a keeper run by systemd leaves the
mount's connection, so that a restart of the whole unit (`systemctl restart`,
`Restart=on-failure`, an upgrade of the keeper itself) keeps the mount.

The protocol (sd_notify(3), sd_listen_fds(3)):
- a datagram to $NOTIFY_SOCKET (a path, or an abstract name written with a
  leading '@'): "FDSTORE=1\\nFDNAME=<name>\\nFDPOLL=0" with the descriptors by
  SCM_RIGHTS; systemd keeps them while the unit restarts
  (FileDescriptorStoreMax= must allow them). FDPOLL=0: systemd must not drop
  a /dev/fuse descriptor when it polls readable (a request waiting).
  "READY=1" once the mount answers (Type=notify); "FDSTOREREMOVE=1\\nFDNAME=<name>"
  when the mount has ended and the descriptors mean nothing any more.
- the next process started gets them from fd 3 on: LISTEN_PID (its pid),
  LISTEN_FDS (how many), LISTEN_FDNAMES (their names, ':'-separated). Under
  Type=forking that is `fsclient mount`, which passes them on to the keeper
  it starts (`pass_on`).

Names used: FUSE_NAME for each /dev/fuse descriptor (the mount's, then its
clones, in order) and SAVED_NAME for the saved-state memfd. A process that is
not systemd uses the same protocol to hand a keeper the connection another
keeper surrendered (`hand_on`), adding PREDECESSOR_NAME: the control
connection to that keeper, which the new keeper acks and then waits on.
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
from collections.abc import Mapping, MutableMapping, Sequence
from functools import partial
from typing import Any, NamedTuple

FUSE_NAME = "fuse"
SAVED_NAME = "saved"
PREDECESSOR_NAME = "predecessor"
LISTEN_FDS_START = 3
# Set by a process that passes systemd's descriptors on to its child (the
# keeper): the child then takes LISTEN_PID as its parent's.
PASSED_ON = "FSCLIENT_LISTEN_FDS_PASSED_ON"


class FdStore:
    """The unit's side of sd_notify, at `address` ($NOTIFY_SOCKET)."""

    def __init__(self, address: str):
        self.address = "\0" + address[1:] if address.startswith("@") else address

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] = os.environ) -> FdStore | None:
        address = env.get("NOTIFY_SOCKET")
        return cls(address) if address else None

    def notify(self, state: str, fds: Sequence[int] = ()) -> None:
        """Send one sd_notify message; OSError if systemd cannot be reached."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(self.address)
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] \
                if fds else []
            sock.sendmsg([state.encode()], ancillary)

    def store(self, fuse_fds: Sequence[int], saved_fd: int) -> None:
        """Hand systemd the connection and its saved state to keep."""
        self.notify(f"FDSTORE=1\nFDNAME={FUSE_NAME}\nFDPOLL=0", fuse_fds)
        self.notify(f"FDSTORE=1\nFDNAME={SAVED_NAME}\nFDPOLL=0", [saved_fd])


class Kept(NamedTuple):
    """A live connection passed to this process."""
    fuse_fds: list[int]
    saved_fd: int
    predecessor: int = -1  # the surrendering keeper's control connection, if any


class Passing:
    """How a child gets descriptors from fd 3 on (`subprocess.Popen`'s env and
    descriptor arguments, `popen`), and `close` our copies after."""

    def __init__(self, env: dict[str, str] | None, keep: tuple[int, ...] = (),
                 high: tuple[int, ...] = ()):
        self.env = env
        self.keep = keep  # passed at their numbers (pass_on)
        self.high = high  # dup'd high, placed at 3.. in the child (hand_on)

    def environment(self, base: Mapping[str, str] | None) -> dict[str, str] | None:
        """The child's environment: `base` (None: ours) with the variables that
        pass the descriptors on."""
        if base is None:
            return self.env
        return {**base, **{k: v for k, v in (self.env or {}).items()
                           if k.startswith("LISTEN_") or k == PASSED_ON}}

    def clear(self, fd: int) -> int:
        """`fd`, at a number where none of the descriptors this passes is
        placed in the child (a duplicate, the original closed, if it was
        there): for one the child also gets at its number (`popen`'s `also`,
        named in its argv), which the placing would otherwise overwrite."""
        top = LISTEN_FDS_START + len(self.high)
        if not LISTEN_FDS_START <= fd < top:
            return fd
        moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top)
        os.close(fd)
        return moved

    def popen(self, *also: int) -> dict[str, Any]:
        """Popen's fd arguments, with `also` passed at their numbers too
        (ValueError if one is where a passed descriptor goes: `clear` it)."""
        if not self.high:
            return {"pass_fds": (*also, *self.keep), "close_fds": True}
        placed = range(LISTEN_FDS_START, LISTEN_FDS_START + len(self.high))
        clashing = [fd for fd in also if fd in placed]
        if clashing:
            raise ValueError(f"descriptors {clashing} would be overwritten in the child by "
                             f"those passed at {placed.start}..{placed.stop - 1}; "
                             f"`clear` them first")
        # pass_fds would have the child close what the placing dup2s make, so
        # nothing is closed here: every descriptor but these is close-on-exec
        return {"preexec_fn": partial(_place, self.high, also), "close_fds": False}

    def close(self) -> None:
        for fd in self.high:
            os.close(fd)
        self.high = ()


def _place(high: tuple[int, ...], also: tuple[int, ...]) -> None:
    """In the child, between fork and exec: only dup2 and fcntl."""
    for i, fd in enumerate(high):
        os.dup2(fd, LISTEN_FDS_START + i)
    for fd in also:
        os.set_inheritable(fd, True)


def listened(env: MutableMapping[str, str] = os.environ) -> Kept | None:
    """The connection systemd (or a parent, `hand_on`) passed this process, or
    None when none was passed (a first start). The LISTEN_*
    variables are removed, so no child takes them for its own; descriptors
    not named here are closed."""
    try:
        pid, count = int(env.get("LISTEN_PID", "0")), int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    names = env.get("LISTEN_FDNAMES", "").split(":")
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(key, None)
    passed_on = env.pop(PASSED_ON, "") == "1"
    if pid != (os.getppid() if passed_on else os.getpid()) or count <= 0:
        return None
    found: dict[str, list[int]] = {FUSE_NAME: [], SAVED_NAME: [], PREDECESSOR_NAME: []}
    for i in range(count):
        fd = LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        name = names[i] if i < len(names) else ""
        if name in found:
            found[name].append(fd)
        else:
            os.close(fd)
    fuse, saved, predecessor = found[FUSE_NAME], found[SAVED_NAME], found[PREDECESSOR_NAME]
    if not fuse or len(saved) != 1 or len(predecessor) > 1:
        for fd in fuse + saved + predecessor:
            os.close(fd)
        return None
    return Kept(fuse, saved[0], predecessor[0] if predecessor else -1)


def pass_on(env: MutableMapping[str, str] = os.environ) -> Passing:
    """For `fsclient mount` under Type=forking, which starts the keeper: the
    descriptors systemd passed this process, kept at their numbers; nothing
    (env None: the child inherits ours) when it passed none."""
    if env.get("LISTEN_PID") != str(os.getpid()):
        return Passing(None, ())
    try:
        count = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return Passing(None, ())
    return Passing({**env, PASSED_ON: "1"},
                   tuple(range(LISTEN_FDS_START, LISTEN_FDS_START + count)))


def hand_on(named: Sequence[tuple[str, int]],
            env: MutableMapping[str, str] = os.environ) -> Passing:
    """Pass (name, fd) pairs to a child as systemd would, from fd 3 on: dup'd
    high first (>= 256), so placing one clobbers no other. A descriptor the
    child also gets at its own number must be out of their way: `clear`."""
    high = tuple(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for _, fd in named)
    return Passing({**env, "LISTEN_PID": str(os.getpid()), "LISTEN_FDS": str(len(high)),
                    "LISTEN_FDNAMES": ":".join(name for name, _ in named), PASSED_ON: "1"},
                   high=high)
