"""What a writer uploaded, put in the host's cache: sealed as fills are, keyed by the new version.

After an upload, its file's blocks go to the daemon on a thread of its own
(`_run`), so close returns once the object is in the remote: each block is
read from the staged file (under its lock, and only while it holds the
bytes uploaded: `generation`), keyed by the new version's key prefix (the
`FileInfo` the reader's metadata will see) and offered to the link's fill
queue, which seals and puts it as any fill (`offer_fill_waiting`: it waits
for room rather than drop: a checkpoint is many blocks). The staged file
is kept until its job is done (`done`), and the first load of the file on
this host reads it warm.

A rename carries the cache: the renamed file's blocks, read from this
host's cache (never from the remote: a block not cached is skipped), are
put again under the new name's keys, only when the new name is known to
hold the same bytes (`RemoteWrites.rename`'s answer). A block file cannot
simply be renamed: its key string is authenticated with it.

Nothing here fails a write or a read: a block that is not put is fetched
by its first reader.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from ..daemonclient.fillqueue import FillQueue
from ..sources.fileinfo import FileInfo
from .stagedfile import StagedFile

log = logging.getLogger(__name__)

FILL_WAIT = 10.0    # seconds a block waits for room in the fill queue before it is dropped

KeyPrefix = Callable[[str, str], str]           # (path, version) -> block key prefix
CachedBlock = Callable[[str, int], "bytes | None"]  # (key, length) -> plaintext if cached


class WrittenBlocks:
    """The background cache fills of one volume's writes in this process."""

    def __init__(self, block_size: int, key_prefix: KeyPrefix, link: FillQueue,
                 cached: CachedBlock):
        self.block_size = block_size
        self._key_prefix = key_prefix
        self._link = link
        self._cached = cached
        self._jobs: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def uploaded(self, staged: StagedFile, info: FileInfo, generation: int,
                 done: Callable[[], None]) -> None:
        """Cache `staged`'s bytes as `info`'s blocks; `done()` once they are read."""
        self._add(("uploaded", staged, info, generation, done))

    def renamed(self, old: FileInfo, new: FileInfo) -> None:
        """Put `old`'s cached blocks again as `new`'s (the same bytes, renamed)."""
        if old.size == new.size and not old.is_dir:
            self._add(("renamed", old, new))

    def _add(self, job: tuple) -> None:
        with self._cv:
            if self._closed:
                if job[0] == "uploaded":
                    job[4]()
                return
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="blockcache-written",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def pending(self) -> int:
        """Jobs not done yet (queued, or the one under way)."""
        return len(self._jobs) + self._busy

    def wait(self, timeout: float) -> bool:
        """True once every job so far is done (its blocks offered)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def close(self) -> None:
        """Stop: jobs not started are dropped (their staged files released)."""
        with self._cv:
            self._closed = True
            jobs, self._jobs = list(self._jobs), collections.deque()
            self._cv.notify_all()
        for job in jobs:
            if job[0] == "uploaded":
                job[4]()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                if job[0] == "uploaded":
                    self._cache_staged(*job[1:4])
                else:
                    self._carry(*job[1:])
            except Exception:  # never kill the thread: a block not put is a later miss
                log.exception("caching the blocks of %s failed", job[2].path)
            finally:
                if job[0] == "uploaded":
                    job[4]()

    def _blocks(self, size: int):
        bs = self.block_size
        for boff in range(0, size, bs):
            yield boff, min(bs, size - boff)

    def _cache_staged(self, staged: StagedFile, info: FileInfo, generation: int) -> None:
        prefix = self._key_prefix(info.path, info.version)
        for boff, n in self._blocks(info.size):
            with staged.lock:
                if staged.disposed or staged.generation != generation or self._closed:
                    return  # written again since the upload: these bytes are not `info`'s
                data = staged.read(boff, n)
            self._link.offer_fill_waiting(prefix + format(boff, "016x"), data, FILL_WAIT)

    def _carry(self, old: FileInfo, new: FileInfo) -> None:
        was = self._key_prefix(old.path, old.version)
        now = self._key_prefix(new.path, new.version)
        for boff, n in self._blocks(old.size):
            if self._closed:
                return
            off = format(boff, "016x")
            data = self._cached(was + off, n)
            if data is not None:
                self._link.offer_fill_waiting(now + off, data, FILL_WAIT)
