"""A function run as another uid (or as nobody): a forked child that drops to
it, for tests whose attackers and bystanders are other uids; and a group for
the daemon's socket that nobody is not in.

Forked, not exec'd: the venv's interpreter may live under /root, which other
uids cannot execute."""

from __future__ import annotations

import grp
import os
import pickle
import pwd
import time
import traceback
from collections.abc import Callable
from typing import Any

NOBODY = pwd.getpwnam("nobody")


class ChildError(Exception):
    """What a function run by `as_uid` raised: type name, errno, message."""

    def __init__(self, kind: str, errno_: int | None, message: str, tb: str):
        super().__init__(f"{kind}: {message}\n{tb}")
        self.kind = kind
        self.errno = errno_
        self.message = message


def as_uid(uid: int, gid: int, fn: Callable[..., Any], *args: Any,
           timeout: float = 30.0) -> Any:
    """fn(*args) in a forked child that became `uid`/`gid` (real, effective
    and saved), no supplementary groups; its result, or ChildError with what
    it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            try:
                out = ("ok", fn(*args))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                out = ("err", (type(exc).__name__, getattr(exc, "errno", None), str(exc),
                               traceback.format_exc()))
            with os.fdopen(w, "wb") as f:
                pickle.dump(out, f)
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    with os.fdopen(r, "rb") as f:
        data = f.read()
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise TimeoutError(f"the child running as uid {uid} did not finish")
        time.sleep(0.01)
    if not data:
        raise ChildError("NoResult", None, f"the child running as uid {uid} died", "")
    kind, value = pickle.loads(data)
    if kind == "err":
        raise ChildError(*value)
    return value


def as_nobody(fn: Callable[..., Any], *args: Any, timeout: float = 30.0,
              gid: int | None = None) -> Any:
    """fn(*args) as uid nobody, gid nobody's (or `gid`), as `as_uid` runs it."""
    return as_uid(NOBODY.pw_uid, NOBODY.pw_gid if gid is None else gid, fn, *args,
                  timeout=timeout)


def socket_group() -> int:
    """A group that is neither root's nor nobody's: the daemon's socket group
    in tests whose children (other uids) join it, or not, as their gid."""
    return next(g.gr_gid for g in grp.getgrall() if g.gr_gid not in (0, NOBODY.pw_gid))
