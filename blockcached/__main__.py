"""`blockcached`: the per-host cache daemon. Wires the parts together and runs.

    blockcached [--config FILE.toml] [--socket PATH] [--cache-dir DIR[:SIZE]]...
                [--socket-mode 0660] [--socket-group NAME|GID] [--admin-gid GID]...
                [--admin-uid UID]... [--volume-access VOL=uid:U,gid:G]...
                [--unlisted-volumes open|admin] [--max-connections-per-uid 1024]
                [--max-reply-bytes-per-uid 64M] [--fill-queue-share 0.5] [--max-volumes 4096]
                [--high-watermark 0.98] [--low-watermark 0.95] [--min-free-bytes 1G]
                [--min-free-inodes N] [--max-entries N] [--fill-queue-bytes 256M]
                [--io-timeout SECONDS] [--log-level info] [--log-format text|json]
                [--metrics-addr HOST:PORT] [--admission-policy tinylfu|lru]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import resource
import signal
import stat
import sys
import time

from blockcache_client.common import logsetup
from blockcache_client.contract.errors import BlockcacheError, ConfigError

from . import config as configmod
from . import lockfile
from . import metrics as metricsmod
from .cache import Cache
from .config import Config
from .sdnotify import Notifier
from .server import Server
from .service import Service

log = logging.getLogger("blockcached")

TICK = 0.25              # seconds between upkeep rounds
DRAIN_ON_STOP = 3.0      # seconds to finish queued writes on SIGTERM


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="blockcached", description="Per-host block cache daemon.")
    p.add_argument("--config", metavar="FILE.toml")
    p.add_argument("--socket", metavar="PATH",
                   help="unix socket (default $BLOCKCACHE_SOCKET or "
                        "/run/blockcache/blockcached.sock)")
    p.add_argument("--cache-dir", dest="cache_dirs", action="append", metavar="DIR[:SIZE]",
                   type=configmod.parse_cache_dir_flag, default=[])
    p.add_argument("--socket-mode", metavar="0660")
    p.add_argument("--socket-group", metavar="NAME|GID")
    p.add_argument("--admin-gid", dest="admin_gids", action="append", metavar="GID")
    p.add_argument("--admin-uid", dest="admin_uids", action="append", metavar="UID",
                   help="admin users (default: root only); --admin-uid '' makes no uid admin")
    p.add_argument("--volume-access", action="append", metavar="VOL=uid:U,gid:G", default=[],
                   help="who besides admins may put, list and evict VOL's blocks")
    p.add_argument("--unlisted-volumes", metavar="open|admin",
                   help="volumes with no access table: open to every peer, or admin only")
    p.add_argument("--max-connections-per-uid", metavar="N")
    p.add_argument("--max-reply-bytes-per-uid", metavar="64M")
    p.add_argument("--fill-queue-share", type=float, metavar="0.5")
    p.add_argument("--max-volumes", metavar="N")
    p.add_argument("--high-watermark", type=float, metavar="0.98",
                   help="a full dir is kept at this share of its limit (default 0.98)")
    p.add_argument("--low-watermark", type=float, metavar="0.95",
                   help="a dir found above the high watermark is trimmed to this (default 0.95)")
    p.add_argument("--min-free-bytes", metavar="1G")
    p.add_argument("--min-free-inodes", metavar="N")
    p.add_argument("--max-entries", metavar="N")
    p.add_argument("--fill-queue-bytes", metavar="256M")
    p.add_argument("--io-timeout", type=float, metavar="SECONDS")
    p.add_argument("--log-level", metavar="info")
    p.add_argument("--log-format", metavar="text|json")
    p.add_argument("--metrics-addr", metavar="HOST:PORT",
                   help="serve Prometheus metrics there (default: off)")
    p.add_argument("--admission-policy", metavar="tinylfu|lru",
                   help="which blocks a full cache keeps: tinylfu (default: a block gets in "
                        "only if asked for more often than the ones it would evict) or lru")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> Config:
    file_values = configmod.load_file(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if k != "config"}
    return configmod.build(file_values, flags)


def setup_logging(cfg: Config) -> None:
    logsetup.setup_logging(cfg.log_level, cfg.log_format)


def raise_fd_limit() -> None:
    """Raise the soft open-files limit to the hard one: every client connection
    is a descriptor, and a soft limit of 1024 (a common default) would make
    the 1025th reader on a busy host fail to connect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)


def prepare_dirs(cfg: Config) -> None:
    """Create the socket's dir and the cache dirs if missing, and refuse any
    the daemon does not own or that group or others can write: whoever can
    write in them could swap what the daemon and the readers trust there
    (a socket, `blocks/`, `tmp/`) for symlinks or FIFOs of their own."""
    dirs = [("socket dir", os.path.dirname(cfg.socket))]
    dirs += [("cache dir", d.path) for d in cfg.cache_dirs]
    me = os.geteuid()
    for what, path in dirs:
        os.makedirs(path, mode=0o755, exist_ok=True)
        st = os.stat(path)
        if st.st_uid != me:
            raise ConfigError(f"{what} {path} is owned by uid {st.st_uid}, not by the uid "
                              f"blockcached runs as ({me}); run `chown {me} {path}`, or use a "
                              f"dir of its own")
        if st.st_mode & 0o022:
            raise ConfigError(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: group "
                              f"or others may write in it; run `chmod go-w {path}` (0755 lets "
                              f"readers in, the socket's own mode decides who connects)")


def take_locks(cfg: Config) -> list[int]:
    """Lock the socket and every cache dir; fds to keep open."""
    fds = [lockfile.acquire(cfg.socket + ".lock", f"socket {cfg.socket}")]
    for d in cfg.cache_dirs:
        fds.append(lockfile.acquire(os.path.join(d.path, "blockcached.lock"),
                                    f"cache dir {d.path}"))
    return fds


async def serve(cfg: Config) -> None:
    loop = asyncio.get_running_loop()
    notifier = Notifier()
    cache = Cache(cfg, loop)
    service = Service(cfg, cache)
    server = Server(cfg, service)
    metrics = metricsmod.start(cfg.metrics_addr, loop, service) if cfg.metrics_addr else None
    await server.start()
    cache.start_rebuild()
    notifier.ready(f"serving on {cfg.socket}")

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def upkeep() -> None:
        last_ping = 0.0
        while True:
            try:
                cache.tick()
            except Exception:  # upkeep must go on; the next tick retries
                log.exception("upkeep failed")
            now = time.monotonic()
            if notifier.watchdog_interval and now - last_ping >= notifier.watchdog_interval:
                notifier.watchdog()
                last_ping = now
            await asyncio.sleep(min(TICK, notifier.watchdog_interval or TICK))

    upkeep_task = loop.create_task(upkeep())
    await stop.wait()
    log.info("stopping: no new connections; writing queued blocks for up to %ss", DRAIN_ON_STOP)
    notifier.stopping()
    await server.close()
    drained = await cache.drain(DRAIN_ON_STOP)
    if not drained:
        log.warning("stopping with %d queued blocks unwritten (they are dropped; the "
                    "tmp/ leftovers are removed at the next start)", len(cache.fill))
    upkeep_task.cancel()
    cache.close()
    if metrics is not None:
        metrics.close()


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 128 << 10


def pin_mmap_threshold() -> None:
    """Keep glibc serving big allocations (dict tables, frame buffers) by mmap.

    By default glibc raises its mmap threshold each time such a block is
    freed, after which big blocks come from the heap and their holes are
    never returned: measured 212 -> 166 B of RSS per index entry after a
    rebuild. Not glibc: nothing to do."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    pin_mmap_threshold()
    try:
        args = parse_args(argv)
        cfg = load_config(args)
    except BlockcacheError as exc:
        print(f"blockcached: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg)
    raise_fd_limit()
    # Cache files and dirs must be readable by readers in other pods/users
    # (0644/0755) whatever umask the service manager gave us.
    os.umask(0o022)
    # a dir's mode or owner is a config error (restarting cannot fix it);
    # a held lock may be gone at the next try
    for step, status in ((prepare_dirs, 2), (take_locks, 1)):
        try:
            done = step(cfg)
        except BlockcacheError as exc:
            print(f"blockcached: {exc}", file=sys.stderr)
            return status
        except OSError as exc:
            print(f"blockcached: cannot prepare {exc.filename or 'a path'}: {exc.strerror}",
                  file=sys.stderr)
            return 1
    locks: list[int] = done  # take_locks' fds, kept open while serving
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:
        log.error("cannot serve: %s", exc)
        return 1
    finally:
        for fd in locks:
            os.close(fd)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
