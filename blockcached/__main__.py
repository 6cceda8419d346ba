"""`blockcached`: the per-host cache daemon. Wires the parts together and runs.

    blockcached [--config FILE.toml] [--socket PATH] [--cache-dir DIR[:SIZE]]...
                [--socket-mode 0660] [--socket-group NAME|GID] [--admin-gid GID]...
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
import sys
import time

from blockcache_client import logsetup
from blockcache_client.errors import BlockcacheError

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
                   help="unix socket (default $BLOCKCACHE_SOCKET or /run/blockcache/blockcached.sock)")
    p.add_argument("--cache-dir", dest="cache_dirs", action="append", metavar="DIR[:SIZE]",
                   type=configmod.parse_cache_dir_flag, default=[])
    p.add_argument("--socket-mode", metavar="0660")
    p.add_argument("--socket-group", metavar="NAME|GID")
    p.add_argument("--admin-gid", dest="admin_gids", action="append", metavar="GID")
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


def take_locks(cfg: Config) -> list[int]:
    """Lock the socket and every cache dir (creating them); fds to keep open."""
    fds = []
    sock_dir = os.path.dirname(cfg.socket)
    os.makedirs(sock_dir, mode=0o755, exist_ok=True)
    fds.append(lockfile.acquire(cfg.socket + ".lock", f"socket {cfg.socket}"))
    for d in cfg.cache_dirs:
        os.makedirs(d.path, mode=0o755, exist_ok=True)
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
    try:
        locks = take_locks(cfg)
    except BlockcacheError as exc:
        print(f"blockcached: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"blockcached: cannot prepare {exc.filename or 'a path'}: {exc.strerror}",
              file=sys.stderr)
        return 1
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
