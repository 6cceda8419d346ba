"""One file version put into the host cache, and known to be there.

`prefetch_ahead` (`ahead.py`) fetches files for readers in other processes,
so the reader's own fill path (`fetch` + `fills`: the memory LRU, a queue
that drops when full, puts whose replies are read later) is not enough: a
file counts as done only when a reader elsewhere would hit it. `HostFill`:

1. checks each block's file through the layout (no round trip, no read):
   blocks cached already cost nothing;
2. reads the missing ones from the source (`Fetcher.read_source`: runs of
   consecutive blocks in one request, ESTALE if the version changed), holding
   their bytes under a `ByteBudget`;
3. seals each block and `put`s it on its own connection, waiting for the
   reply (a full daemon queue is retried a few times, briefly);
4. `written`, called by whoever hands the file on (the consumer, when its
   turn comes): each accepted block's file is at its path (the daemon
   writes on its dir's worker after replying), waited for up to
   `WRITE_WAIT`. By then the write has mostly landed: one lstat per block,
   where a fill thread waiting right after its puts slept and woke several
   times per file.

Source requests run on the fill thread itself (`inline`, no hop to the
backend's pool): the caller bounds its wait for a fill with `patience`.

A block the daemon declines, or that does not appear in time, makes the file
"dropped": its readers then miss and fetch it themselves, which is still
correct. Nothing is kept in this process's memory LRU: the readers are
elsewhere. Errors of the source (a file deleted, ESTALE) are raised to the
caller, which counts them; the reader's own read reports them.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ...contract.errors import DaemonError, DaemonUnavailable
from ...daemonclient.client import Client
from ...daemonclient.link import DaemonLink
from ...sources.backend import FileInfo
from ..hits.blockhits import HitReader
from ..misses.fetch import Fetcher
from ..options import WRITE_WAIT

log = logging.getLogger(__name__)

PUT_TIMEOUT = 5.0         # seconds one put may take on the wire
BUSY_RETRIES = 5          # puts retried while the daemon's queue is full
_BUSY = frozenset({"queue_full", "over_share"})
_ON_ITS_WAY = frozenset({"queued", "duplicate"})  # accepted, or another writer's is queued


class FillParts(Protocol):
    """What a host fill uses of its volume in this process (`parts.ReadParts`)."""

    block_size: int
    window: int                            # blocks one source request may bring
    hits: HitReader                        # is a block cached
    fetcher: Fetcher                       # the source's reads
    link: DaemonLink                       # the daemon's layout
    key_prefix: Callable[[str, str], str]  # (path, version) -> the blocks' key prefix


class Cancelled(Exception):
    """The prefetch was closed: this file's work stops where it is."""


class ByteBudget:
    """Bytes held by fetches in flight. `hold(n)` waits until `n` more fit;
    when nothing is held anything fits, so a block larger than the whole
    budget still goes, alone."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int, cancelled: threading.Event):
        with self._cv:
            while self.used and self.used + n > self.limit:
                if cancelled.is_set():
                    raise Cancelled
                self._cv.wait(0.05)  # a close does not notify: look again soon
            self.used += n
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            with self._cv:
                self.used -= n
                self._cv.notify_all()


class HostFill:
    """Puts files of one `Volume` into the host cache (thread-safe; built in
    and used by the process that owns the volume: `Volume.host_fill`)."""

    def __init__(self, parts: FillParts, seal: Callable[[str, bytes], memoryview],
                 socket_path: str, daemon_uid: int | None, budget: ByteBudget,
                 cancelled: threading.Event):
        """`parts`: this process's pieces of the volume; `seal(key,
        plaintext)`: the block file's bytes, sealed under the volume key."""
        self.block_size = parts.block_size
        self._key_prefix = parts.key_prefix
        self._hits = parts.hits
        self._fetcher = parts.fetcher
        self._link = parts.link
        self._seal = seal
        # blocks one source request may bring: the reader's sequential window,
        # and at most half the budget (a run is held twice: plain and sealed)
        self._run = max(1, min(parts.window, budget.limit // (4 * parts.block_size)))
        self._budget = budget
        self._cancelled = cancelled
        self._connect = lambda: Client(socket_path, timeout=PUT_TIMEOUT, daemon_uid=daemon_uid)
        # idle connections: a Client carries one request at a time, so puts
        # sharing one would queue behind each other's round trips; there are
        # at most as many as puts ever ran at once (<= the threads)
        self._clients: queue.SimpleQueue[Client] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.reading = 0       # source requests in flight now
        self.max_reading = 0   # and at most so far

    @property
    def connected(self) -> bool:
        """The volume knows the daemon's layout: there is a host cache to fill."""
        return self._link.connected

    def close(self) -> None:
        while True:
            try:
                self._clients.get_nowait().close()
            except queue.Empty:
                return

    @property
    def patience(self) -> float:
        """Seconds the consumer waits for one file's fill: its source
        request with every retry, and a put. Past that the source is hung
        (an inline request has no timeout of its own) or the file is too
        large to wait for; its reader fetches it (a miss, still correct)."""
        backend = self._fetcher.backend
        return backend.timeout * backend.attempts + PUT_TIMEOUT

    def fill(self, info: FileInfo) -> tuple[str, list[str]]:
        """Put `info`'s blocks into the host cache: ("cached", []) if all
        were, ("dropped", []) if the daemon declined some, else ("filled",
        keys): every missing block accepted, at its path once `written(keys)`.
        Raises what the source raised, or `Cancelled`."""
        rel, bs = info.path, self.block_size
        prefix = self._key_prefix(rel, info.version)
        missing = [boff for boff in range(0, info.size, bs)
                   if not self._hits.is_cached(prefix + format(boff, "016x"))]
        if not missing:
            return "cached", []
        sent: list[str] = []
        dropped = False
        for start, stop in self._runs(missing, info.size):
            if self._cancelled.is_set():
                raise Cancelled
            with self._budget.hold(2 * (stop - start), self._cancelled):
                for i, data in enumerate(self._read(info, start, stop)):
                    key = prefix + format(start + i * bs, "016x")
                    if self._put(key, self._seal(key, data)):
                        sent.append(key)
                    else:
                        dropped = True
        return ("dropped", []) if dropped else ("filled", sent)

    def _runs(self, missing: list[int], size: int):
        """(start, stop) byte ranges of consecutive missing blocks, at most
        `_run` blocks each."""
        bs = self.block_size
        i = 0
        while i < len(missing):
            j = i + 1
            while j < len(missing) and j - i < self._run and missing[j] == missing[j - 1] + bs:
                j += 1
            yield missing[i], min(size, missing[j - 1] + bs)
            i = j

    def _read(self, info: FileInfo, start: int, stop: int) -> list[bytes]:
        with self._lock:
            self.reading += 1
            self.max_reading = max(self.max_reading, self.reading)
        try:
            return self._fetcher.read_source(info.path, info, start, stop, inline=True)
        finally:
            with self._lock:
                self.reading -= 1

    def _put(self, key: str, blob: memoryview) -> bool:
        """Hand one sealed block to the daemon; True if it is on its way to
        the disk (or there already)."""
        pause = 0.01
        for attempt in range(BUSY_RETRIES + 1):
            try:
                client = self._clients.get_nowait()
            except queue.Empty:
                client = self._connect()
            try:
                accepted, reason = client.put(key, blob)
            except (DaemonUnavailable, DaemonError) as exc:
                log.debug("prefetch put %s: %s", key, exc)
                return False
            finally:
                self._clients.put(client)
            if accepted or reason in _ON_ITS_WAY or reason == "exists":
                return True
            if reason not in _BUSY or attempt == BUSY_RETRIES or self._cancelled.wait(pause):
                log.debug("prefetch put %s declined: %s", key, reason)
                return False
            pause *= 2
        return False

    def written(self, keys: list[str]) -> bool:
        """Wait until every key's block file is at its path; False if one is
        still missing after `WRITE_WAIT` (or the prefetch was closed)."""
        deadline = time.monotonic() + WRITE_WAIT
        pause = 0.001
        for key in keys:
            while not self._hits.is_cached(key):
                if time.monotonic() > deadline or self._cancelled.is_set():
                    return False
                time.sleep(pause)  # Event.wait would build a lock per call
                pause = min(0.02, pause * 2)
        return True
