"""Parts sent while a file is still being written: a sequential writer's upload overlaps its writes.

A checkpoint is written front to back, so by its close most of it could be
in the remote already. Once a staged file holds more than two parts, each
part the writer has moved a unit past (`advance`, after each write) is
sent in the background as a part of a multipart upload begun for the file.
A part written again afterwards (a seek back to patch a header) is sent
again at the commit, which sends whatever is not in the remote as written
(`finish`) and completes. Parts are not objects: nothing is visible before
the completion, so `close` still makes the object appear whole, or not at
all.

- One part number is never in flight twice (S3 keeps whichever lands last,
  and the completion names the ETag each was answered with): a part in
  flight is not sent again until it is answered, and the commit first
  waits for those in flight (`pause`, before it takes the staged file's
  lock, which each background send takes to read its part).
- A part that failed in the background is sent again at the commit; if the
  upload could not even begin, the commit uploads as if nothing had been
  sent.
- A file dropped without a commit (discarded, unlinked, released after a
  failed commit), or one whose size now needs another part size, has its
  multipart upload aborted (`drop`): nothing of it stays.
- Memory: a background part takes a buffer of the uploader's shared ones
  only if one is free (else the next write tries again), at most
  `parallel` per file.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

from ..sources.fileinfo import FileInfo
from .stagedfile import UNIT, StagedFile
from .upload import Uploader, part_size

log = logging.getLogger(__name__)


class Stream:
    """The multipart upload of one staged file, sent as it is written."""

    def __init__(self, uploader: Uploader, staged: StagedFile):
        self.uploader = uploader
        self.staged = staged
        self.part = part_size(0, uploader.part_bytes, uploader.remote.min_part)
        self.upload = None                     # the multipart upload, once begun
        self.upload_rel = ""                   # the name it was begun for
        self.clean: set[int] = set()           # parts in the remote as staged now
        self.changes: dict[int, int] = {}      # part -> writes to it so far
        self.inflight: dict[int, concurrent.futures.Future] = {}
        self.paused = False
        self.failed = False                    # the upload could not begin
        self._lock = threading.Lock()
        self._begin = threading.Lock()

    def changed(self, lo: int, hi: int | None) -> None:
        """Bytes [lo, hi) changed (hi None: everything from lo, a truncate);
        called by the staged file under its lock."""
        first = lo // self.part
        with self._lock:
            if hi is None:  # every part from `first` on that was sent or is being sent
                touched = [k for k in {*self.clean, *self.inflight, *self.changes} if k >= first]
            else:
                touched = range(first, (max(hi, lo + 1) - 1) // self.part + 1)
            for k in touched:
                self.clean.discard(k)
                self.changes[k] = self.changes.get(k, 0) + 1

    def advance(self, end: int) -> None:
        """A write ended at `end`: send the parts it has moved a unit past."""
        part = self.part
        if self.paused or self.failed or self.staged.size <= 2 * part:
            return
        with self._lock:
            ready = [k for k in range(max(0, (end - UNIT) // part))
                     if k not in self.clean and k not in self.inflight]
            room = self.uploader.parallel - len(self.inflight)
        for k in ready[:max(0, room)]:
            pair = self.uploader.take(part, self.staged.stride, wait=False)
            if pair is None:
                return
            with self._lock:
                if self.paused or k in self.inflight:
                    self.uploader.give(pair)
                    return
                self.inflight[k] = self.uploader.threads().submit(self._send, k, pair)

    def _send(self, k: int, pair: tuple[bytearray, bytearray]) -> None:
        buf, scratch = pair
        try:
            with self.staged.lock:
                if self.staged.disposed:
                    return
                size = self.staged.size
                n = min(self.part, size - k * self.part)
                if n < self.part:  # (the file shrank: the commit sends it)
                    return
                self.staged.flush()
                with self._lock:
                    seen = self.changes.get(k, 0)
                view = memoryview(buf)[:n]
                self.staged.snapshot().read_into(k * self.part, view, scratch)
            upload = self._begun()
            upload.part(k + 1, k * self.part, view)
            with self._lock:
                if self.changes.get(k, 0) == seen:
                    self.clean.add(k)
        except Exception as exc:  # (sent again at the commit)
            log.debug("part %d of %s not sent ahead: %s", k + 1, self.staged.rel, exc)
        finally:
            self.uploader.give(pair)
            with self._lock:
                self.inflight.pop(k, None)

    def _begun(self):
        with self._begin:
            if self.upload is None:
                try:
                    self.upload_rel = self.staged.rel
                    self.upload = self.uploader.remote.begin(self.upload_rel)
                except Exception:
                    self.failed = True
                    raise
            return self.upload

    def pause(self) -> None:
        """No more background sends; those in flight answered (the commit:
        called before it takes the staged file's lock)."""
        with self._lock:
            self.paused = True
            running = list(self.inflight.values())
        concurrent.futures.wait(running)

    def resume(self) -> None:
        with self._lock:
            self.paused = False

    def finish(self, snap) -> FileInfo | None | bool:
        """Upload what is left and complete (the commit, under the staged
        file's lock, after `pause`); False when nothing was sent ahead that
        fits (the caller then uploads the usual way)."""
        size = snap.size
        fits = part_size(size, self.uploader.part_bytes, self.uploader.remote.min_part)
        if self.upload is None or size <= self.part or fits != self.part \
                or self.staged.rel != self.upload_rel:  # (renamed while open)
            self.drop()
            return False
        upload, self.upload = self.upload, None
        count = -(-size // self.part)
        with self._lock:
            todo = [k + 1 for k in range(count) if k not in self.clean]
            self.clean.clear()
            self.changes.clear()
        try:
            self.uploader.parts(upload, snap, self.part, todo)
            return upload.complete(size, count)
        except BaseException:
            upload.abort()
            raise

    def drop(self) -> None:
        """Abort what was sent ahead (in the background: never raises)."""
        self.pause()
        upload, self.upload = self.upload, None
        with self._lock:
            self.clean.clear()
            self.changes.clear()
        if upload is not None:
            self.uploader.threads().submit(upload.abort)
