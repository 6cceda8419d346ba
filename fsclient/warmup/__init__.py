"""`fsclient warmup`: load a volume's files into the host cache, check or evict them.

    fsclient warmup --config VOLUME.toml [PATHS...] [-f FILELIST] [-p N] [--shard I/N]
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
- Cooperative (`--shard I/N`, `shard.py`): N hosts each warm the files of
  their shard from the remote, so every file is fetched once over all of
  them; the hosts then read the rest from the cluster tier. Which files are
  a shard's depends on the volume path alone, so hosts agree without talking.
- `--check` prints, per path given, how much of it is in the cache now
  (bytes and percent, by blocks present); `--evict` removes the blocks of
  those files (all versions) through the daemon.

Metadata comes straight from the source (`volume.backend`), not through the
reader's TTL cache: warmup wants the current version of each file, and a long
list must not fill a cache it never reads again.

Symbolic links are not followed (a link is listed as skipped), so a walk
cannot loop or leave the volume.

Modules: this entry point; `targets` (which files), `shard` (which of them
are this host's), `fetch` (the fetching and its summary), `check` (`--check`,
`--evict`), `progress`, `interrupts`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterable
from typing import Any, TextIO

from blockcache_client.contract.errors import ConfigError

from .check import run_check
from .fetch import Warmup, summary
from .interrupts import EXIT_FAILED, EXIT_INTERRUPTED, raise_interrupted
from .progress import Progress
from .shard import Shard, parse_shard
from .targets import Target, read_file_list, targets

__all__ = ["Shard", "default_parallel", "mount_config", "parse_shard", "read_file_list", "run",
           "targets"]

log = logging.getLogger(__name__)

XATTR_CONFIG = "user.blockcache.config"
CONNECT_TIMEOUT = 10.0     # seconds to wait for the reader to reach blockcached


def default_parallel() -> int:
    """Fetches in flight by default: remote reads are mostly waiting, so a few per
    core, at least 8 (2 cores -> 8) and at most 64 (64 cores -> 64)."""
    return max(8, min(64, (os.cpu_count() or 2)))


def wait_connected(volume: Any, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Whether the reader reached blockcached (got its layout) within `timeout`."""
    deadline = time.monotonic() + timeout
    while not volume.stats()["daemon_connected"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


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
        out: TextIO, err: TextIO, progress_interval: float, shard: Shard | None = None) -> int:
    """Run one mode to the end; returns the exit code. `shard` (warming only):
    warm just that shard's files."""
    if not wait_connected(volume):
        err.write(f"fsclient: error: blockcached is not reachable at {volume.socket_path}; "
                  f"warmup needs the daemon (start it, or check --socket)\n")
        return EXIT_FAILED
    old = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if mode == "warm":
            return _warm(volume, items, parallel, fill_queue_bytes, out, err, progress_interval,
                         shard)
        return run_check(volume, mode, items, parallel, out)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _warm(volume: Any, items: Iterable[Target], parallel: int, fill_queue_bytes: int,
          out: TextIO, err: TextIO, progress_interval: float, shard: Shard | None) -> int:
    w = Warmup(volume, parallel, fill_queue_bytes, shard)
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
