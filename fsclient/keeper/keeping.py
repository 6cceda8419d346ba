"""`fsclient mount --foreground` runs the keeper (`keeper.keeper`): it checks
the mount point, then keeps a server process (`fsclient mount --serve-fd N`,
which opens the volume and serves, `mount.run`) on the connection it holds.

On a mount point whose keeper is alive, `fsclient mount` and `fsclient restart`
ask that keeper for a live restart instead: a new server (the code installed
now) takes the connection over without unmounting. A control name held by a
process we do not trust (another uid) is refused, naming its pid and uid
(`control.check`): it is asked nothing.

The keeper opens the volume key itself (`--key-file`, or takes `--key-fd`)
and hands each server an open descriptor of it on their socket (`handoff`,
"key"), which the server asks for once it is not dumpable: a server, maybe
another uid, never opens the key file, and no process of its uid can take
the descriptor from it.

A keeper started with a live connection passed from fd 3 on (LISTEN_FDS,
`fdstore.listened`: systemd's fd store, or a parent that was surrendered the
connection, `fdstore.hand_on`) adopts it instead of mounting.
"""

from __future__ import annotations

import logging
import os
import sys

from blockcache_client.contract.errors import BlockcacheError
from blockcache_client.volumekey import load_key_fd, open_key_file

from .. import mountpoint as mp
from ..config import MountConfig
from ..mount import Readiness
from ..mountpoint import MountError
from . import keeper as keeping
from .client import restart
from .control import describe_holder, listen
from .fdstore import FdStore, Kept, listened
from .successor import KEY_FLAG, KEY_FROM_PREDECESSOR, key_from_predecessor, without_options

log = logging.getLogger(__name__)


def server_command(argv: list[str], sock_fd: int, ready_fd: int | None) -> list[str]:
    """The server's command line: this `fsclient mount` one, with the keeper's
    socket, and the readiness fd for the first server only. The server asks
    that socket for the key (`--key-from-keeper`), once it is not dumpable."""
    out = without_options(argv, "--ready-fd", "--key-fd", flags=(KEY_FLAG,))
    if ready_fd is not None:
        out += ["--ready-fd", str(ready_fd)]
    return [sys.executable, "-m", "fsclient.cli", *out, KEY_FLAG, "--serve-fd", str(sock_fd)]


def open_key(cfg: MountConfig, kept: Kept | None) -> int:
    """The volume key's descriptor (close-on-exec), checked: the one the
    server that started this keeper sends (`successor`), or `--key-fd`'s,
    else the key file opened here. BlockcacheError says what is wrong. The
    server's uid may own it (it is that server's key)."""
    owners = (cfg.server_user.uid,) if cfg.server_user is not None else ()
    if kept is not None and kept.predecessor >= 0 and os.environ.pop(KEY_FROM_PREDECESSOR, ""):
        try:
            fd = key_from_predecessor(kept.predecessor)
        except OSError as exc:
            raise MountError(str(exc)) from None
        what = "the key its server sent"
    elif cfg.key_fd is not None:
        fd, what = cfg.key_fd, f"--key-fd {cfg.key_fd}"
        os.set_inheritable(fd, False)
    else:
        return open_key_file(cfg.key_file or "", owners)
    load_key_fd(fd, what, owners)
    return fd


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
        readiness.error(f"cannot take {path} over: its control socket is "
                        f"{describe_holder(path)}")
        return 1
    if control is None:
        # a live keeper holds this mount point: restart its server (`restart`
        # checks who holds the name before it asks: a squatter is refused)
        try:
            answer = restart(path)
        except MountError as exc:
            readiness.error(str(exc))
            return 1
        readiness.warn(f"{path} was mounted already; its server was restarted "
                       f"(now pid {answer['server']})")
        readiness.ready()
        return 0
    try:
        key_fd = open_key(cfg, kept)
    except BlockcacheError as exc:
        control.close()
        readiness.error(str(exc))
        return 1
    store = FdStore.from_env()
    k = keeping.Keeper(path, cfg.fuse_options(), cfg.threads,
                       lambda fd, ready: server_command(argv, fd, ready), store,
                       run_as=cfg.server_user, key_fd=key_fd)
    if kept is not None:  # systemd kept it across the unit's restart, or a keeper surrendered it
        log.info("taking over %s from %s (%d FUSE descriptors)", path,
                 "the keeper before" if kept.predecessor >= 0 else "systemd's fd store",
                 len(kept.fuse_fds))
        k.adopt(kept.fuse_fds, kept.saved_fd, kept.predecessor)
    else:
        try:
            # no keeper holds `path`: a mount there is its dead keeper's, and
            # its server ends it once it notices
            mp.await_orphan(path, readiness.warn)
            mp.prepare(path, readiness.warn)
        except MountError as exc:
            control.close()
            k.close()
            readiness.error(str(exc))
            return 1
    return k.run(ready_fd, control)
