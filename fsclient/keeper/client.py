"""What other processes ask a mount's keeper, as the CLI and the CSI plugin
ask it: `restart` its server, its `status`, and what its server `recovered`.
(`control` speaks the socket; this is the asking side's face.)
"""

from __future__ import annotations

import json
import os
from typing import Any

from .. import mountpoint as mp
from ..mountpoint import MountError
from ..session.structs import RESEND_MINOR
from .control import Impostor, ask

RESTART_TIMEOUT = 120.0


def _ask(path: str, op: str, timeout: float, expect_pid: int | None) -> dict[str, Any]:
    path = mp.absolute(path)
    try:
        answer = ask(path, op, timeout, expect_pid)
    except Impostor:
        raise  # (a MountError too: its message names the holder and the fix)
    except (ConnectionRefusedError, FileNotFoundError):
        raise MountError(f"no fsclient keeper serves {path}; is it mounted by "
                         f"`fsclient mount`?") from None
    except OSError as exc:
        raise MountError(f"the keeper of {path} did not answer: {exc}") from None
    if "error" in answer:
        raise MountError(f"{op} of {path} failed: {answer['error']}")
    return answer


def restart(path: str, timeout: float = RESTART_TIMEOUT,
            expect_pid: int | None = None) -> dict[str, Any]:
    """Replace the server of the mount on `path` without unmounting; the keeper's
    status once the new server answers. Impostor if the keeper is not one we
    trust (root or our uid; pid `expect_pid` if given: `control.check`)."""
    return _ask(path, "restart", timeout, expect_pid)


def status(path: str, expect_pid: int | None = None) -> dict[str, Any]:
    """The keeper's and the server's pids and the restarts of the mount on
    `path`; Impostor as for `restart`."""
    return _ask(path, "status", 10.0, expect_pid)


def recovered(path: str) -> dict[str, int]:
    """What the serving server took over from the ones before it (node ids found
    in the saved state, open handles made again), what the saved state holds
    now, and the server's memory and node table against their bounds (from the
    root's `user.blockcache.stats`); empty if the mount does not answer."""
    try:
        from ..xattrs import XATTR_STATS  # (xattrs imports the node table, which imports us)

        raw = os.getxattr(mp.absolute(path), XATTR_STATS.decode())
        stats = json.loads(raw)["fsclient"]
    except (OSError, ValueError, KeyError):
        return {}
    return {k: stats[k] for k in ("nodes_recovered", "handles_recovered", "saved_nodes",
                                  "saved_bytes", "saved_cap_bytes", "saved_compactions",
                                  "server_rss_bytes", "server_rss_bound_bytes", "nodes",
                                  "max_nodes", "nodes_peak", "fuse_minor")
            if k in stats}


def guarantee(fuse_minor: int | None) -> str:
    """What a restart, a takeover or a killed server costs a reader on a mount
    that speaks FUSE 7.`fuse_minor` (fsclient/DESIGN.md, "The keeper")."""
    if fuse_minor is None:
        return "unknown (the mount did not answer)"
    if fuse_minor >= RESEND_MINOR:
        return (f"no failed read on restart, takeover or kill -9 "
                f"(FUSE 7.{fuse_minor}: the kernel resends a killed server's requests)")
    return (f"no failed read on restart or takeover; a kill -9 answers the killed "
            f"server's requests EINTR (page-cache reads are read again, synchronous "
            f"ones fail EINTR, which Python's open and read retry) (FUSE 7.{fuse_minor}: no resend "
            f"before 7.{RESEND_MINOR}, Linux 6.9)")
