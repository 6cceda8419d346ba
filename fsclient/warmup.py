"""`fsclient warmup`: load a volume's files into the host cache, check or evict them.

    fsclient warmup --config VOLUME.toml [PATHS...] [-f FILELIST] [-p N]
    fsclient warmup --mount MOUNTPOINT   [PATHS...] [--check | --evict]
    fsclient warmup SOURCE --volume NAME --key-file FILE [--block-size 4M] [PATHS...]

The blocks go through the reader (`Volume`), exactly as a training job's
reads would: a block is read from the source once and handed to blockcached
as a fill. So the keys, the block size and the volume key are the mount's,
and a later read of the same file version is a hit.

How it works, and what it promises
- Streaming: directories are walked depth first, with the listings of the
  next few directories fetched in parallel, and a file list is read line by
  line; entries of a file list are stat-ed by a window of at most
  `2 * parallel` threads (in order), and at most `2 * parallel` block fetches
  are in flight. So memory stays bounded by the window, not the number of
  files, and the first fetch starts at once.
- Resumable: before fetching, each block is checked through the daemon's
  layout (does its block file exist?), never read; a block already cached
  is counted and skipped. A run that is interrupted (Ctrl-C, SIGTERM) stops
  submitting, finishes its in-flight fetches, hands their fills to the daemon
  (up to `DRAIN_TIMEOUT`), prints its summary and exits 130; running it again
  fetches only what is still missing. A block whose fill the daemon accepted
  but had not written yet when the next run checks is fetched again (the
  daemon answers `duplicate`); that window is the daemon's write queue.
- Fills are never silently lost: the reader's fill queue drops blocks when
  it is full, so fetches wait while it is more than `FILL_HIGH` full, and any
  fills dropped anyway are reported as a failure (exit 1; run it again).
- `--check` prints, per path given, how much of it is in the cache now
  (bytes and percent, by blocks present); `--evict` removes the blocks of
  those files (all versions) through the daemon.

Metadata comes straight from the source (`volume.backend`), not through the
reader's TTL cache: warmup wants the current version of each file, and a long
list must not fill a cache it never reads again.

Symbolic links are not followed (a link is listed as skipped), so a walk
cannot loop or leave the volume.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

from blockcache_client.contract.errors import BlockcacheError, ConfigError
from blockcache_client.contract.units import format_size
from blockcache_client.fileinfo import FileInfo, normalize

log = logging.getLogger(__name__)

XATTR_CONFIG = "user.blockcache.config"
DRAIN_TIMEOUT = 30.0       # seconds to hand in-flight fills to the daemon at the end
CONNECT_TIMEOUT = 10.0     # seconds to wait for the reader to reach blockcached
FILL_HIGH = 0.5            # fraction of the reader's fill queue above which fetches wait
MAX_LISTED_FAILURES = 50   # failures printed by name in the summary (all are counted)
LIST_AHEAD = 8             # directory listings fetched ahead of the walk
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


def default_parallel() -> int:
    """Fetches in flight by default: remote reads are mostly waiting, so a few per
    core, at least 8 (2 cores -> 8) and at most 64 (64 cores -> 64)."""
    return max(8, min(64, (os.cpu_count() or 2)))


# -- which files ---------------------------------------------------------------


@dataclass
class Target:
    """One path as the user gave it, and what it resolved to."""

    given: str
    rel: str
    error: str | None = None


def to_volume_path(path: str, mountpoint: str | None) -> str:
    """A path as given (volume-relative, or absolute under the mount point) to
    the volume-relative form; ValueError for an absolute path elsewhere."""
    if mountpoint and os.path.isabs(path):
        mp = os.path.normpath(mountpoint)
        p = os.path.normpath(path)
        if p == mp:
            return ""
        if not p.startswith(mp + os.sep):
            raise ValueError(f"{path} is not under the mount point {mountpoint}")
        path = p[len(mp) + 1:]
    return normalize(path)


def read_file_list(stream: TextIO) -> Iterator[str]:
    """Paths from a file list, one a line, lazily; blank lines and '#' comments skipped."""
    for line in stream:
        line = line.rstrip("\r\n")
        if line and not line.startswith("#"):
            yield line


def targets(paths: Iterable[str], file_list: Iterable[str],
            mountpoint: str | None) -> Iterator[Target]:
    """Every path argument, then every file list entry; the root if there are none."""
    any_given = False
    for source in (paths, file_list):
        for given in source:
            any_given = True
            try:
                yield Target(given, to_volume_path(given, mountpoint))
            except (ValueError, OSError) as exc:
                yield Target(given, "", error=str(exc))
    if not any_given:
        yield Target("/", "")


def walk(volume: Any, info: FileInfo,
         on_error: Callable[[str, BaseException], None] | None = None,
         pool: ThreadPoolExecutor | None = None, ahead: int = LIST_AHEAD,
         on_link: Callable[[FileInfo], None] | None = None) -> Iterator[FileInfo]:
    """Regular files at or beneath `info`, depth first.

    With a `pool`, the listings of the next `ahead` directories to visit run
    in parallel while this one's files are handed out (a remote listing is a
    round trip; one at a time, a tree of many small dirs would be walked at
    the speed of its latency). Outstanding listings stay bounded: at most
    `ahead` per level of depth. A directory that cannot be listed goes to
    `on_error` (the walk goes on) or, without one, raises. Symbolic links
    are not followed; `on_link` hears of each."""
    if info.is_link:
        if on_link is not None:
            on_link(info)
        return
    if not info.is_dir:
        yield info
        return
    stack = [info.path]
    listing: dict[str, Future] = {}
    while stack:
        if pool is not None:
            for p in stack[-ahead:]:
                if p not in listing:
                    listing[p] = pool.submit(volume.backend.listdir, p)
        d = stack.pop()
        dirs = []
        try:
            fut = listing.pop(d, None)
            entries = _result(fut) if fut is not None else volume.backend.listdir(d)
        except (OSError, BlockcacheError) as exc:
            if on_error is None:
                raise
            on_error(d, exc)
            continue
        for entry in entries:
            if entry.is_link:
                if on_link is not None:
                    on_link(entry)
                continue
            if entry.is_dir:
                dirs.append(entry.path)
            else:
                yield entry
        stack.extend(reversed(dirs))


def bounded_map(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: Iterable[Any],
                window: int) -> Iterator[tuple[Any, Future]]:
    """(item, future of fn(item)) in the order of `items`, with at most `window`
    submitted ahead (ThreadPoolExecutor.map would consume `items` whole first)."""
    pending: collections.deque[tuple[Any, Future]] = collections.deque()
    for item in items:
        pending.append((item, pool.submit(fn, item)))
        if len(pending) >= window:
            yield pending.popleft()
    while pending:
        yield pending.popleft()


def _result(fut: Future) -> Any:
    """fut.result(), waiting in short steps so Ctrl-C is seen at once."""
    while True:
        try:
            return fut.result(timeout=0.5)
        except TimeoutError:
            continue


def resolved(volume: Any, pool: ThreadPoolExecutor, items: Iterable[Target],
             window: int) -> Iterator[tuple[Target, FileInfo | None]]:
    """(target, its FileInfo or None with target.error set), stat-ed in parallel, in order."""
    def stat(t: Target) -> FileInfo | None:
        return None if t.error else volume.backend.stat(t.rel)

    for t, fut in bounded_map(pool, stat, items, window):
        try:
            info = _result(fut)
        except (OSError, BlockcacheError) as exc:
            t.error = _reason(exc)
            info = None
        yield t, info


def _reason(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "not found in the volume"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({exc.__class__.__name__})" if not exc.filename else str(exc)
    return str(exc) or exc.__class__.__name__


# -- progress ------------------------------------------------------------------


@dataclass
class Tally:
    """What a warmup did so far; updated from worker threads under `lock`."""

    files: int = 0
    bytes: int = 0
    cached_bytes: int = 0
    cached_blocks: int = 0
    fetched_bytes: int = 0
    failed_bytes: int = 0
    skipped_links: int = 0
    failures: dict[str, str] = field(default_factory=dict)
    failed_count: int = 0
    listed_all: bool = False   # enumeration finished: `bytes` is the total
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fail(self, path: str, reason: str) -> None:
        with self.lock:
            if path in self.failures:
                return
            self.failed_count += 1
            if len(self.failures) < MAX_LISTED_FAILURES:
                self.failures[path] = reason

    @property
    def done_bytes(self) -> int:
        return self.cached_bytes + self.fetched_bytes + self.failed_bytes


class Progress:
    """A one-line bar redrawn on a terminal; a plain line every `interval` s otherwise."""

    def __init__(self, tally: Tally, out: TextIO, tty: bool, interval: float):
        self.tally = tally
        self.out = out
        self.tty = tty
        self.interval = 0.2 if tty else interval
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="warmup-progress", daemon=True)

    def start(self) -> Progress:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.tty:
            self.out.write("\r\x1b[K")
            self.out.flush()

    def _run(self) -> None:
        if self.tty:  # a terminal shows the bar at once, then redraws it in place
            self._draw()
        while not self._stop.wait(self.interval):
            self._draw()

    def _draw(self) -> None:
        line = self.line()
        self.out.write(f"\r\x1b[K{line}" if self.tty else line + "\n")
        self.out.flush()

    def line(self) -> str:
        t = self.tally
        elapsed = max(time.monotonic() - self.started, 1e-6)
        done = t.done_bytes
        rate = t.fetched_bytes / elapsed
        if t.listed_all and t.bytes:
            frac = min(1.0, done / t.bytes)
            left = (t.bytes - done) / (done / elapsed) if done else float("inf")
            eta = _clock(left)
            bar = "#" * int(frac * 20)
            head = f"[{bar:<20}] {100 * frac:5.1f}% "
        else:
            eta, head = "?", "[listing...] "
        return (f"warmup {head}files {t.files}  {format_size(done)} of "
                f"{format_size(t.bytes)}{'' if t.listed_all else '+'}  "
                f"fetched {format_size(t.fetched_bytes)} at {format_size(rate)}/s  "
                f"failed {t.failed_count}  ETA {eta}")


def _clock(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# -- the three modes -----------------------------------------------------------


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; the run stops submitting and reports."""


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def wait_connected(volume: Any, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Whether the reader reached blockcached (got its layout) within `timeout`."""
    deadline = time.monotonic() + timeout
    while not volume.stats()["daemon_connected"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Warmup:
    """Fetch every uncached block of the targets, `parallel` at a time."""

    def __init__(self, volume: Any, parallel: int, fill_queue_bytes: int):
        self.volume = volume
        self.parallel = parallel
        self.fill_limit = int(fill_queue_bytes * FILL_HIGH)
        self.tally = Tally()
        self.interrupted: str | None = None
        self._slots = threading.BoundedSemaphore(2 * parallel)
        self._stats_pool = ThreadPoolExecutor(parallel, thread_name_prefix="warmup-stat")
        self._fetch_pool = ThreadPoolExecutor(parallel, thread_name_prefix="warmup-fetch")

    def run(self, items: Iterable[Target]) -> None:
        t = self.tally
        try:
            for target, info in resolved(self.volume, self._stats_pool, items, 2 * self.parallel):
                if info is None:
                    t.fail(target.given, target.error or "unknown error")
                    continue
                try:
                    for f in walk(self.volume, info, lambda d, exc: t.fail(d, _reason(exc)),
                                  self._stats_pool, on_link=self._link):
                        self._file(f)
                except (OSError, BlockcacheError) as exc:
                    t.fail(target.given, _reason(exc))
            t.listed_all = True
        except Interrupted as exc:
            self.interrupted = str(exc)
            # a second Ctrl-C (or SIGTERM) while in-flight work drains ends the process at once
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        finally:
            self._stats_pool.shutdown(wait=False, cancel_futures=True)
            self._finish()

    def _link(self, info: FileInfo) -> None:
        with self.tally.lock:
            self.tally.skipped_links += 1

    def _file(self, info: FileInfo) -> None:
        t = self.tally
        with t.lock:
            t.files += 1
            t.bytes += info.size
        for off, length, cached in self.volume.block_map(info.path, info):
            if cached:
                with t.lock:
                    t.cached_bytes += length
                    t.cached_blocks += 1
                continue
            self._wait_fill_room()
            while not self._slots.acquire(timeout=0.5):
                pass
            fut = self._fetch_pool.submit(self._fetch, info, off, length)
            fut.add_done_callback(lambda _: self._slots.release())

    def _wait_fill_room(self) -> None:
        """The reader drops fills when its queue is full: don't outrun the daemon."""
        while self.volume.stats()["fill_queue_bytes"] > self.fill_limit:
            time.sleep(0.01)

    def _fetch(self, info: FileInfo, off: int, length: int) -> None:
        t = self.tally
        try:
            self.volume.read(info.path, off, length, info)
        except Exception as exc:  # one bad file must not stop the others
            with t.lock:
                t.failed_bytes += length
            t.fail(info.path, _reason(exc))
            return
        with t.lock:
            t.fetched_bytes += length

    def _finish(self) -> None:
        """Let in-flight fetches end and hand their fills to the daemon."""
        self._fetch_pool.shutdown(wait=True)
        if not self.volume.wait_fills(DRAIN_TIMEOUT):
            self.tally.fail("(fill queue)", f"fills not all handed to blockcached within "
                                            f"{DRAIN_TIMEOUT:g}s; run warmup again")


def summary(w: Warmup, elapsed: float, stats: dict[str, Any]) -> str:
    """The end-of-run report."""
    t = w.tally
    state = f"interrupted ({w.interrupted})" if w.interrupted else "done"
    # What came from the source, by the reader's own counts: a read of a
    # file's first block fetches the blocks after it in the same request
    # (coalesced), so an interrupted run may have fetched (and handed over)
    # blocks its own reads had not reached yet. Every block fetched is
    # offered to the daemon once: sent, or dropped and counted.
    fetched_bytes = stats["backend_bytes"]
    fetched_blocks = stats["fills_sent"] + stats["fills_dropped"]
    rate = fetched_bytes / elapsed if elapsed > 0 else 0.0
    lines = [
        f"warmup {state} in {elapsed:.1f}s: {t.files} files, {format_size(t.bytes)}",
        f"  already cached  {format_size(t.cached_bytes)} ({t.cached_blocks} blocks)",
        f"  fetched         {format_size(fetched_bytes)} ({fetched_blocks} blocks, "
        f"{format_size(rate)}/s; {stats.get('backend_requests', 0)} source requests)",
        f"  failed          {t.failed_count} path{'s' if t.failed_count != 1 else ''}"
        + (f", {format_size(t.failed_bytes)}" if t.failed_bytes else ""),
    ]
    if stats.get("fills_dropped"):
        lines.append(f"  fills dropped   {stats['fills_dropped']} (fetched but not cached: "
                     f"blockcached was unreachable or full; run warmup again)")
    if t.skipped_links:
        lines.append(f"  links skipped   {t.skipped_links}")
    for path, reason in t.failures.items():
        lines.append(f"    {path}: {reason}")
    if t.failed_count > len(t.failures):
        lines.append(f"    ... and {t.failed_count - len(t.failures)} more")
    return "\n".join(lines)


@dataclass
class PathReport:
    """Cached bytes of one given path (a file, or a directory's files summed)."""

    given: str
    files: int = 0
    size: int = 0
    cached: int = 0
    evicted: int = 0
    error: str | None = None


def inspect(volume: Any, pool: ThreadPoolExecutor, items: Iterable[Target], window: int,
            evict: bool) -> Iterator[PathReport]:
    """Per target: its cached bytes (`--check`) or the blocks evicted (`--evict`)."""
    for target, info in resolved(volume, pool, items, window):
        r = PathReport(target.given)
        if info is None:
            r.error = target.error
            yield r
            continue
        try:
            for f in walk(volume, info, pool=pool):
                r.files += 1
                r.size += f.size
                if evict:
                    r.evicted += volume.evict(f.path, f)
                else:
                    r.cached += volume.cached_bytes(f.path, f)
        except (OSError, BlockcacheError) as exc:
            r.error = _reason(exc)
        yield r


def _pct(cached: int, size: int) -> str:
    return f"{100.0 * cached / size:6.1f}%" if size else "   100%"


def check_line(r: PathReport) -> str:
    if r.error:
        return f"  error   {r.given}: {r.error}"
    return (f"{_pct(r.cached, r.size)}  {format_size(r.cached):>10} of "
            f"{format_size(r.size):<10}  {r.files:>7} files  {r.given}")


# -- entry point ---------------------------------------------------------------


def mount_config(mountpoint: str) -> dict[str, Any]:
    """The settings of the fsclient mount on `mountpoint`, from its root's
    `user.blockcache.config` xattr (volume TOML keys, as JSON)."""
    try:
        raw = os.getxattr(mountpoint, XATTR_CONFIG)
    except OSError as exc:
        raise ConfigError(f"cannot read the volume settings of {mountpoint} "
                          f"({XATTR_CONFIG}: {exc.strerror}); is it an fsclient mount? "
                          f"Give --config VOLUME.toml instead") from None
    data = json.loads(raw)
    if data.pop("storage_options_hidden", False):
        log.warning("the mount hides its storage_options from this user; warmup runs "
                    "without them (run as the mount's owner or root, or use --config)")
    return data


def run(volume: Any, mode: str, items: Iterable[Target], parallel: int, fill_queue_bytes: int,
        out: TextIO, err: TextIO, progress_interval: float) -> int:
    """Run one mode to the end; returns the exit code."""
    if not wait_connected(volume):
        err.write(f"fsclient: error: blockcached is not reachable at {volume.socket_path}; "
                  f"warmup needs the daemon (start it, or check --socket)\n")
        return EXIT_FAILED
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if mode == "warm":
            return _warm(volume, items, parallel, fill_queue_bytes, out, err, progress_interval)
        return _inspect(volume, mode, items, parallel, out)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _warm(volume: Any, items: Iterable[Target], parallel: int, fill_queue_bytes: int,
          out: TextIO, err: TextIO, progress_interval: float) -> int:
    w = Warmup(volume, parallel, fill_queue_bytes)
    before = volume.stats()
    started = time.monotonic()
    progress = Progress(w.tally, err, err.isatty(), progress_interval).start()
    try:
        w.run(items)
    finally:
        progress.stop()
    after = volume.stats()
    delta = {k: after[k] - before[k]
             for k in ("backend_requests", "backend_bytes", "fills_dropped", "fills_sent")}
    out.write(summary(w, time.monotonic() - started, delta) + "\n")
    out.flush()
    if w.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if w.tally.failed_count or delta["fills_dropped"] else 0


def _inspect(volume: Any, mode: str, items: Iterable[Target], parallel: int, out: TextIO) -> int:
    evict = mode == "evict"
    total = PathReport("total")
    failed = 0
    pool = ThreadPoolExecutor(parallel, thread_name_prefix="warmup-stat")
    try:
        for r in inspect(volume, pool, items, 2 * parallel, evict):
            if r.error:
                failed += 1
            total.files += r.files
            total.size += r.size
            total.cached += r.cached
            total.evicted += r.evicted
            if evict:
                out.write(f"  error   {r.given}: {r.error}\n" if r.error else
                          f"evicted {r.evicted:>7} blocks  {r.files:>7} files  {r.given}\n")
            else:
                out.write(check_line(r) + "\n")
            out.flush()
    except Interrupted as exc:
        out.write(f"interrupted ({exc})\n")
        return EXIT_INTERRUPTED
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if evict:
        out.write(f"evicted {total.evicted} blocks of {total.files} files"
                  f"{f'; {failed} paths failed' if failed else ''}\n")
    else:
        out.write(f"total: {_pct(total.cached, total.size).strip()} cached "
                  f"({format_size(total.cached)} of {format_size(total.size)}) in "
                  f"{total.files} files{f'; {failed} paths failed' if failed else ''}\n")
    return EXIT_FAILED if failed else 0
