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
clones, in order) and SAVED_NAME for the saved-state memfd.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import MutableMapping, Sequence

FUSE_NAME = "fuse"
SAVED_NAME = "saved"
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


def listened(env: MutableMapping[str, str] = os.environ) -> tuple[list[int], int] | None:
    """(the /dev/fuse descriptors, the saved-state memfd) systemd passed this
    process, or None when it passed none (a first start). The LISTEN_*
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
    fuse: list[int] = []
    saved: list[int] = []
    for i in range(count):
        fd = LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        name = names[i] if i < len(names) else ""
        (fuse if name == FUSE_NAME else saved if name == SAVED_NAME else []).append(fd)
        if name not in (FUSE_NAME, SAVED_NAME):
            os.close(fd)
    if not fuse or len(saved) != 1:
        for fd in fuse + saved:
            os.close(fd)
        return None
    return fuse, saved[0]


def pass_on(env: MutableMapping[str, str] = os.environ) -> tuple[dict[str, str] | None,
                                                                tuple[int, ...]]:
    """For `fsclient mount` under Type=forking, which starts the keeper: (the
    child's environment, the descriptors to keep open at their numbers) when
    systemd passed this process descriptors; (None, ()) otherwise."""
    if env.get("LISTEN_PID") != str(os.getpid()):
        return None, ()
    try:
        count = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return None, ()
    return ({**env, PASSED_ON: "1"},
            tuple(range(LISTEN_FDS_START, LISTEN_FDS_START + count)))
