"""A server that runs without root: the keeper (root, it mounts) starts its
server as another uid, with no capability left in any set.

`drop` runs in the child between fork and exec (Popen's preexec_fn; the keeper
is single-threaded). In that order:
- every capability leaves the bounding set (needs CAP_SETPCAP, so first): no
  file capability or setuid binary can give one back;
- the supplementary groups become `groups` (e.g. the group of blockcached's
  socket), then the gid and the uid (real, effective, saved). Changing the
  uid from 0 clears the permitted, effective and ambient sets;
- no_new_privs: exec never gains privileges again (fusermount3 stays unprivileged).

After exec (which makes a process dumpable again) every server and keeper
calls `not_dumpable` first thing, before it reads its key: a process of the
same uid may then neither read its memory (/proc/PID/mem, ptrace) nor its
environment, nor take its descriptors (pidfd_getfd), and no core is dumped.

The server needs nothing else: the keeper hands it every descriptor it uses
on the connection and an O_PATH descriptor of the mount's root
(`handoff`), so it need not even search the mount point's parent dirs.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
CAP_LAST_CAP = "/proc/sys/kernel/cap_last_cap"

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Credentials:
    """Who a server runs as: uid, gid and supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @classmethod
    def parse(cls, user: str, groups: tuple[int, ...] = ()) -> Credentials:
        """`UID:GID` (numbers: a container need not know the names); ValueError says why."""
        uid, sep, gid = user.partition(":")
        if not sep or not uid.isdigit() or not gid.isdigit():
            raise ValueError(f"server user {user!r} must be UID:GID in numbers, e.g. 65534:65534")
        if int(uid) == 0:
            raise ValueError("server user: uid 0 is root; give an unprivileged uid, e.g. 65534")
        return cls(int(uid), int(gid), tuple(dict.fromkeys(int(g) for g in groups)))


def _prctl(option: int, arg: int) -> int:
    return _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                       ctypes.c_ulong(0))


def drop(creds: Credentials) -> None:
    """Become `creds` with no capabilities (in the child, before exec). A
    process that is `creds` already (a keeper its server started,
    `successor`) has none to drop and may change nothing: it only keeps
    no_new_privs."""
    if os.geteuid() != 0 and (os.getuid(), os.getgid()) == (creds.uid, creds.gid):
        return _no_new_privs()
    with open(CAP_LAST_CAP) as f:
        last = int(f.read())
    for cap in range(last + 1):
        if _prctl(PR_CAPBSET_DROP, cap) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot drop capability {cap} from the bounding set: "
                               f"{os.strerror(err)}")
    os.setgroups(list(creds.groups))
    os.setresgid(creds.gid, creds.gid, creds.gid)
    os.setresuid(creds.uid, creds.uid, creds.uid)
    _no_new_privs()


def _no_new_privs() -> None:
    if _prctl(PR_SET_NO_NEW_PRIVS, 1) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot set no_new_privs: {os.strerror(err)}")


def not_dumpable() -> None:
    """PR_SET_DUMPABLE 0: this process's memory, environment and descriptors
    are root's to see, even for its own uid (it holds a volume key)."""
    if _prctl(PR_SET_DUMPABLE, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot clear the dumpable flag: {os.strerror(err)}")
