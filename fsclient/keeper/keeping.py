"""`fsclient mount --foreground` runs the keeper (`keeper.keeper`): it checks
the mount point, then keeps a server process (`fsclient mount --serve-fd N`,
which opens the volume and serves, `mount.run`) on the connection it holds.

On a mount point whose keeper is alive, `fsclient mount` and `fsclient restart`
ask that keeper for a live restart instead: a new server (the code installed
now) takes the connection over without unmounting.

A keeper started with a live connection passed from fd 3 on (LISTEN_FDS,
`fdstore.listened`: systemd's fd store, or a parent that was surrendered the
connection, `fdstore.hand_on`) adopts it instead of mounting.
"""

from __future__ import annotations

import logging
import os
import sys

from .. import mountpoint as mp
from ..config import MountConfig
from ..mount import Readiness
from ..mountpoint import MountError
from . import keeper as keeping
from .client import restart
from .control import listen
from .fdstore import FdStore, listened
from .successor import without_options

log = logging.getLogger(__name__)

def server_command(argv: list[str], sock_fd: int, ready_fd: int | None) -> list[str]:
    """The server's command line: this `fsclient mount` one, with the keeper's
    socket, and the readiness fd for the first server only."""
    out = without_options(argv, "--ready-fd")
    if ready_fd is not None:
        out += ["--ready-fd", str(ready_fd)]
    return [sys.executable, "-m", "fsclient.cli", *out, "--serve-fd", str(sock_fd)]


def run(cfg: MountConfig, argv: list[str], ready_fd: int | None) -> int:
    """Be the keeper of `cfg`'s mount; the exit code."""
    readiness = Readiness(ready_fd)
    path = mp.absolute(cfg.mountpoint)
    kept = listened()
    control = listen(path)
    if control is None and kept is not None:
        for fd in [*kept.fuse_fds, kept.saved_fd, kept.predecessor]:
            if fd >= 0:
                os.close(fd)
        readiness.error(f"cannot take {path} over: another keeper holds its control socket")
        return 1
    if control is None:  # a live keeper holds this mount point: restart its server
        try:
            answer = restart(path)
        except MountError as exc:
            readiness.error(str(exc))
            return 1
        readiness.warn(f"{path} was mounted already; its server was restarted "
                       f"(now pid {answer['server']})")
        readiness.ready()
        return 0
    store = FdStore.from_env()
    k = keeping.Keeper(path, cfg.fuse_options(), cfg.threads,
                       lambda fd, ready: server_command(argv, fd, ready), store,
                       run_as=cfg.server_user)
    if kept is not None:  # systemd kept it across the unit's restart, or a keeper surrendered it
        log.info("taking over %s from %s (%d FUSE descriptors)", path,
                 "the keeper before" if kept.predecessor >= 0 else "systemd's fd store",
                 len(kept.fuse_fds))
        k.adopt(*kept)
    else:
        try:
            # no keeper holds `path`: a mount there is its dead keeper's, and
            # its server ends it once it notices
            mp.await_orphan(path, readiness.warn)
            mp.prepare(path, readiness.warn)
        except MountError as exc:
            control.close()
            readiness.error(str(exc))
            return 1
    return k.run(ready_fd, control)
