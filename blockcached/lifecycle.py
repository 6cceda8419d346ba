"""The daemon's life: checks at start, serving, and a clean stop.

`run(cfg)` is what `blockcached` does once its config is built (cli.py):
refuse cache and socket dirs others could tamper with, lock them, serve the
socket while the index is rebuilt alongside, and on SIGTERM stop taking
connections and write what is queued for a few seconds.
"""

from __future__ import annotations

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
    never returned, which grows the RSS per index entry after a rebuild.
    Not glibc: nothing to do."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


def run(cfg: Config) -> int:
    """Serve until SIGTERM/SIGINT; the exit status."""
    pin_mmap_threshold()
    logsetup.setup_logging(cfg.log_level, cfg.log_format)
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
