"""Run one mount: in the foreground, or as a background child that reports
readiness to the `fsclient mount` that started it.

Readiness protocol (child -> parent, one pipe, text lines):

    WARN <message>     something the user should see (e.g. daemon absent)
    READY              the mount answers: stat(mountpoint) went through FUSE
    ERROR <message>    the mount cannot be made; the child exits non-zero

The parent returns 0 on READY; on ERROR, on EOF without READY (the child
died) or after `ready_timeout` it prints the reason, makes sure the child is
gone and nothing stays mounted, and returns 1. So `fsclient mount` never
returns success for a mount that does not work, and never hangs.

Shutdown: SIGTERM/SIGINT unmount lazily (open files do not block the exit);
the session's workers end when the connection does, and a connection that
open files keep alive is aborted (their reads then fail with ENOTCONN); then
the volume is closed. (Under systemd, with the connection in the unit's fd
store, the keeper decides: a stop unmounts, a restart hands over.) This
process is a keeper's server (`keeper.keeper`):
if it dies, the keeper starts another on the same connection; if the keeper
dies, it starts the next keeper and hands over to it (`keeper.successor`),
or, failing that, ends the connection, leaving a dead mount that the next
`fsclient mount` on that mount point recovers (`mountpoint.prepare`).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from blockcache_client.contract import protocol
from blockcache_client.contract.errors import BlockcacheError, DaemonError, DaemonUnavailable
from blockcache_client.daemonclient.client import Client

from . import mountpoint as mp
from .config import MountConfig
from .gctune import tune_gc
from .keeper import successor
from .keeper.fdstore import Passing, pass_on
from .keeper.handoff import HANDED_OVER, RESTART_SIGNAL, Connection, KeeperLink
from .keeper.saved import SavedState, SavedStateError
from .mountkey import check_key, inherited, volume_key
from .mountpoint import MountError
from .session import mount as fusemount

log = logging.getLogger(__name__)

SOURCE_TIMEOUT = 30.0
READY_TIMEOUT = 90.0
# The kernel's readahead window on the mount (its bdi), which also caps the
# size of each FUSE read it sends: 128 KiB by default, so a 150 KiB file took
# two requests and a 4 MiB block 32. 1 MiB (the largest request libfuse
# takes) serves a whole small file, or a quarter block, per request.
KERNEL_READAHEAD_KB = 1024
# A server handing over waits this long for the requests it handles; those left
# are resent to its successor (before FUSE 7.40 answered EINTR: `Session.drain`).
HANDOVER_DRAIN = 20.0


class Readiness:
    """The child's end of the readiness pipe (a no-op in plain foreground mode)."""

    def __init__(self, fd: int | None = None):
        self._fd = fd

    def _send(self, line: str) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
        except OSError:
            pass  # the parent is gone; the mount goes on

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def warn(self, message: str) -> None:
        log.warning("%s", message)
        self._send(f"WARN {message}")

    def ready(self) -> None:
        self._send("READY")
        self._close()

    def error(self, message: str) -> None:
        log.error("%s", message)
        self._send(f"ERROR {message}")
        self._close()


def _in_thread(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run a blocking call with a timeout (the thread is abandoned on timeout)."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed to the caller as is
            box.append((False, exc))

    t = threading.Thread(target=run, name=what, daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise TimeoutError(f"{what} did not finish within {timeout:g}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def check_daemon(cfg: MountConfig, readiness: Readiness) -> None:
    """Warn (never fail) when blockcached cannot be reached: reads then go to
    the source uncached, and the volume reconnects when the daemon comes up."""
    path = cfg.socket or protocol.default_socket()
    try:
        with Client(path, timeout=3.0) as c:
            c.ping()
    except (DaemonUnavailable, DaemonError) as exc:
        readiness.warn(f"blockcached is not reachable ({exc}); mounting uncached: reads go "
                       f"to {cfg.source} until the daemon is up, then use the cache")


def open_volume(cfg: MountConfig) -> Any:
    """Create the Volume; it stats the source root, so an unreachable, missing or
    non-directory source fails here, by name, within SOURCE_TIMEOUT."""
    from blockcache_client import Volume

    def make() -> Any:
        # meta_ttl=0: the mount's own caches hold its metadata (per-prefix
        # TTLs) and ask the volume for fresh answers; it keeps none twice
        vol = Volume(cfg.volume, cfg.source, volume_key(cfg), socket_path=cfg.socket,
                     block_size=cfg.block_size, meta_ttl=0,
                     fill_queue_bytes=cfg.fill_queue_bytes,
                     memory_cache_bytes=cfg.memory_cache_bytes, staging_dir=cfg.staging_dir,
                     staging_bytes=cfg.staging_bytes, **cfg.storage_options)
        if cfg.writable:
            try:  # a source that takes no writes, or no staging dir: say so now
                vol.check_writable()
            except BaseException:
                vol.close()
                raise
        return vol

    try:
        return _in_thread(make, SOURCE_TIMEOUT, "source check")
    except BlockcacheError:
        raise
    except FileNotFoundError:
        raise MountError(f"source {cfg.source} does not exist") from None
    except NotADirectoryError:
        raise MountError(f"source {cfg.source} is a file, not a directory") from None
    except TimeoutError:
        raise MountError(f"source {cfg.source} did not answer within {SOURCE_TIMEOUT:g}s; "
                         f"check the URL, endpoint and network") from None
    except Exception as exc:
        raise MountError(f"cannot reach source {cfg.source}: {exc}") from None


def run(cfg: MountConfig, readiness: Readiness, link: KeeperLink) -> int:
    """Serve the mount the keeper holds (`link`) until it ends, or until the
    keeper asks to hand over; returns the exit code."""
    from .fs import BlockcacheFS
    from .session import Session

    mountpoint = mp.absolute(cfg.mountpoint)
    try:
        check_key(cfg)
        check_daemon(cfg, readiness)
        volume = open_volume(cfg)
    except BlockcacheError as exc:
        readiness.error(str(exc))
        return 1
    fs = BlockcacheFS(volume, cfg)
    metrics = None
    conn = None
    try:
        try:
            conn = link.connect()
            state = SavedState(conn.saved_fd)
        except (OSError, ValueError, SavedStateError) as exc:
            readiness.error(f"cannot mount {cfg.source} on {mountpoint}: {exc} (is /dev/fuse "
                            f"available, and are you root or is fusermount3 setuid?)")
            return 1
        fs.nodes.saved = state
        fs.keeper = conn.keeper
        session = Session(fs, cfg.threads, terms=None if conn.fresh else state.terms,
                          writable=cfg.writable)
        session.on_init = state.save_terms
        fs.attach(session)
        if cfg.metrics_addr:
            from . import metrics as fsmetrics
            try:
                metrics = fsmetrics.start(cfg.metrics_addr, volume, fs, session)
            except OSError as exc:
                readiness.error(f"cannot serve metrics on {cfg.metrics_addr}: {exc}; choose "
                                f"a free HOST:PORT for metrics_addr")
                return 1
        fs.open_files.store = session.notify_store if conn.fresh else None  # (see handles)
        return _serve(session, conn, fs, mountpoint, readiness, link)
    finally:
        if metrics is not None:
            metrics.close()
        fs.close()
        volume.close()
        if conn is not None:
            conn.close()


def _serve(session: Any, conn: Connection, fs: Any, mountpoint: str, readiness: Readiness,
           link: KeeperLink) -> int:
    """Serve until a signal, DESTROY, an unmount from outside (then unmount), or
    the keeper's handover (then leave the mount to the successor)."""
    stop = threading.Event()
    handover = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if conn.stored:  # systemd signals every process of the unit: the keeper decides
            log.info("%s: left to the keeper of %s", signal.Signals(signum).name, mountpoint)
            return
        log.info("%s: unmounting %s", signal.Signals(signum).name, mountpoint)
        stop.set()

    def on_handover() -> None:
        handover.set()
        stop.set()

    def on_unmount() -> None:
        log.info("the keeper ends %s: unmounting", mountpoint)
        stop.set()

    def on_keeper_lost() -> None:
        # (ending or handing over already: no keeper is wanted)
        if not conn.stored and not stop.is_set() and successor.take_over(
                sys.argv[1:], conn.fuse_fds, conn.saved_fd, mountpoint, fs.cfg.key_fd):
            return on_handover()  # to the keeper this server started
        # ending the process closes the last descriptors of the connection (but
        # systemd's): the kernel aborts it, and the mount answers ENOTCONN
        log.error("the keeper of %s is gone; %s", mountpoint,
                  "the connection stays in systemd's store" if conn.stored
                  else "ending the FUSE connection")
        fs.open_files.pages.stop()  # (a store waiting on a page would keep it open)
        os._exit(1)

    previous = {sig: signal.signal(sig, on_signal)
                for sig in (signal.SIGTERM, signal.SIGINT, RESTART_SIGNAL)}
    tune_gc()
    session.start(conn.fuse_fds[0], conn.fuse_fds[1:], taken_over=not conn.fresh)
    if not conn.fresh:
        resent = session.resend()
        fs.nodes.recovered = 0
        log.info("took over %s (restart %d): %d saved nodes, %s", mountpoint, conn.restarts,
                 len(fs.nodes.saved.paths), "requests resent" if resent else "no resend")
    link.watch(on_handover, on_unmount, on_keeper_lost)
    dev = _ready(session, fs, mountpoint, readiness, conn.root_fd, conn.fresh)
    conn.close_root()  # it would keep the mount busy
    if dev is not None:
        link.serving()
    try:
        while dev is not None and not stop.is_set() and not session.ended.is_set():
            stop.wait(0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if handover.is_set() or (dev is None and not conn.fresh):
        # (a live mount this server could not probe is never unmounted: the
        # keeper starts another server, which is resent what is left)
        answered = session.drain(HANDOVER_DRAIN)
        log.info("handed %s over (%s; %d read while handing over)", mountpoint,
                 "all requests answered" if answered else "some left to the successor",
                 session.read_draining)
        return HANDED_OVER if handover.is_set() else 1
    session.stop()
    if mp.is_mounted(mountpoint):
        try:
            fusemount.unmount_lazy(mountpoint)
        except OSError as exc:
            log.warning("%s", exc)
    # open files keep a lazily unmounted connection alive: end it, as
    # closing the last descriptor of a libfuse process would
    if not session.join(1.0) and dev is not None:
        fusemount.abort_connection(dev)
        session.join(2.0)
    session.close()
    log.info("unmounted %s", mountpoint)
    return 0 if dev is not None else 1


def _ready(session: Any, fs: Any, mountpoint: str, readiness: Readiness,
           root_fd: int = -1, fresh: bool = True) -> int | None:
    """Report READY once a stat of the mount point (its root's descriptor if
    given), made by another thread, was answered by the session through the
    kernel (end to end); the mount's device number, or None (ERROR reported).
    A live mount taken over with no root descriptor (its keeper may not
    search the path: `keeper.successor`) served already: READY at once."""
    entry = None if fresh or root_fd >= 0 else mp.find_mount(mountpoint)
    if entry is not None:
        readiness.ready()
        return entry.device
    box: list = []

    def probe() -> None:
        try:
            box.append(os.stat(root_fd if root_fd >= 0 else mountpoint))
            if not fresh:  # (a request the kernel never answers from its caches: a
                # session taken over without resend answers its predecessor's first)
                os.statvfs(root_fd if root_fd >= 0 else mountpoint)
        except OSError as exc:
            box.append(exc)

    t = threading.Thread(target=probe, name="ready-probe", daemon=True)
    t.start()
    deadline = time.monotonic() + READY_TIMEOUT
    while t.is_alive() and not session.ended.is_set() and time.monotonic() < deadline:
        t.join(0.1)
    if box and not isinstance(box[0], OSError):
        fusemount.set_kernel_readahead(box[0].st_dev, KERNEL_READAHEAD_KB)
        log.info("mounted %s on %s", fs.cfg.source, mountpoint)
        readiness.ready()
        return box[0].st_dev
    why = box[0] if box else "the session ended" if session.ended.is_set() else "timed out"
    readiness.error(f"mount {mountpoint} did not answer: {why}")
    return None


def spawn(argv: list[str], cfg: MountConfig, log_file: str | None,
          ready_timeout: float = READY_TIMEOUT, detach: bool = True,
          passed: Passing | None = None, env: Mapping[str, str] | None = None
          ) -> tuple[subprocess.Popen | None, str | None]:
    """Start `fsclient <argv> --foreground` as a child and wait for readiness.

    Returns (child, None) once it is READY, or (None, reason) after making
    sure the failed child is gone and left nothing mounted. `detach`: the child
    in its own session (Ctrl-C misses it); `passed`: a connection for it to keep;
    `env`: its whole environment (None: ours), plus those passing the connection.
    """
    # Never touch a mount that was there before: only one our child made.
    premounted = mp.is_mounted(cfg.mountpoint)
    passing = passed or pass_on()  # a kept connection is for the keeper (Type=forking)
    r, w = os.pipe()
    w = passing.clear(w)
    cmd = [sys.executable, "-m", "fsclient.cli", *argv, "--foreground", "--ready-fd", str(w)]
    out = open(log_file, "ab") if log_file else open(os.devnull, "wb")
    try:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 env=passing.environment(env), start_new_session=detach,
                                 **passing.popen(w, *inherited(cfg)))
    finally:
        os.close(w)
        out.close()
    try:
        status, message = _await_ready(r, child, ready_timeout)
    finally:
        os.close(r)
    if status == "READY":
        log.info("mounted %s on %s (pid %d)", cfg.source, cfg.mountpoint, child.pid)
        return child, None
    _reap(child, None if premounted else cfg.mountpoint)
    if status == "ERROR":
        return None, message
    if status == "TIMEOUT":
        return None, (f"the mount of {cfg.mountpoint} did not become ready within "
                      f"{ready_timeout:g}s; run with --foreground to see why")
    return None, (f"the mount process exited (code {child.returncode}) before "
                  f"{cfg.mountpoint} was ready; run with --foreground"
                  + (f" or see {log_file}" if log_file else "") + " to see why")


def run_background(argv: list[str], cfg: MountConfig, log_file: str | None,
                   ready_timeout: float = READY_TIMEOUT) -> int:
    """`fsclient mount` without --foreground: 0 once the child is READY, else 1
    with the reason on stderr."""
    child, why = spawn(argv, cfg, log_file, ready_timeout)
    if child is None:
        _echo(f"fsclient: error: {why}")
        return 1
    return 0


def _echo(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _await_ready(r: int, child: subprocess.Popen, timeout: float) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "TIMEOUT", ""
        ready, _, _ = select.select([r], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(r, 4096)
        if not chunk:
            return "EOF", ""
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            text = line.decode("utf-8", "replace")
            kind, _, message = text.partition(" ")
            if kind == "WARN":
                _echo(f"fsclient: warning: {message}")
            elif kind in ("READY", "ERROR"):
                return kind, message


def _reap(child: subprocess.Popen, mountpoint: str | None) -> None:
    """Make sure a child that failed is gone and left no mount on `mountpoint`
    (None: the mount point was already mounted before; leave it alone)."""
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    try:
        if mountpoint is not None and mp.is_mounted(mountpoint):
            mp.unmount(mp.absolute(mountpoint), lazy=True)
    except MountError as exc:
        log.warning("%s", exc)


def unmount(path: str, lazy: bool = False, timeout: float = 30.0) -> None:
    """`fsclient umount`: unmount, then wait until the mount point is free."""
    path = mp.absolute(path)
    if not mp.is_mounted(path):
        raise MountError(f"{path} is not mounted")
    entry = mp.find_mount(path)
    if entry is not None and not entry.fstype.startswith("fuse"):
        raise MountError(f"{path} is a {entry.fstype} mount, not an fsclient (FUSE) mount")
    mp.unmount(path, lazy=lazy)
    deadline = time.monotonic() + timeout
    while mp.is_mounted(path) and time.monotonic() < deadline:
        time.sleep(0.05)

