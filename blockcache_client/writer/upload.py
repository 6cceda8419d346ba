"""A staged file to the remote as one object: one PUT, or a multipart upload in parallel.

A file of at most `part_bytes` is one `put`. A larger one is a multipart
upload (`RemoteWrites.begin`) of parts of `part_bytes` (more if the file
would need over `MAX_PARTS`), each decrypted from the staging file into a
buffer and sent by one of `parallel` threads; `complete` makes the object
appear whole. The first part that fails stops the rest (those under way
finish or fail), and the upload is aborted: nothing of it stays visible.

Memory: the part buffers are the uploader's, shared by every upload of
the volume at once: at most `parallel` of them (a part and a sealed unit
each), made at the first large upload and kept (`buffer_bytes`); a part
larger than `part_bytes` (a file over MAX_PARTS x part_bytes) gets its own.

The caller holds the staged file's lock throughout (`Snapshot`), so the
bytes sent are the bytes staged when the upload began.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading

from ..sources.fileinfo import FileInfo
from ..sources.remotewrites import RemoteWrites
from .stagedfile import UNIT, Snapshot

MAX_PARTS = 10_000         # S3's limit
DEFAULT_PART_BYTES = 8 << 20
DEFAULT_PARALLEL = 8


def part_size(size: int, part_bytes: int, min_part: int) -> int:
    """The part size for a file of `size` bytes: `part_bytes` (at least the
    source's smallest part), raised to a whole number of units if the file
    would need more than MAX_PARTS parts."""
    part = max(part_bytes, min_part, -(-size // MAX_PARTS))
    return -(-part // UNIT) * UNIT


class Uploader:
    """Uploads of one volume's staged files; its threads send the parts."""

    def __init__(self, remote: RemoteWrites, part_bytes: int = DEFAULT_PART_BYTES,
                 parallel: int = DEFAULT_PARALLEL):
        self.remote = remote
        self.part_bytes = int(part_bytes)
        self.parallel = max(1, int(parallel))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # (part buffer, sealed-unit scratch) pairs, `parallel` at most, shared
        self._buffers: queue.SimpleQueue = queue.SimpleQueue()
        self._made = 0

    def buffer_bytes(self, stride: int) -> int:
        """The most bytes the part buffers take (see the module doc)."""
        return self.parallel * (max(self.part_bytes, UNIT) + stride)

    def take(self, part: int, stride: int, wait: bool = True
             ) -> tuple[bytearray, bytearray] | None:
        """A part buffer of at least `part` bytes and a scratch unit: a free
        one, a new one while fewer than `parallel` exist, else the next one
        given back (None at once if not `wait`). Give it back with `give`."""
        with self._pool_lock:
            make = self._buffers.empty() and self._made < self.parallel
            if make:
                self._made += 1
        if make:
            return bytearray(-(-max(self.part_bytes, part) // UNIT) * UNIT), bytearray(stride)
        try:
            buf, scratch = self._buffers.get(block=wait)
        except queue.Empty:
            return None
        if len(buf) < part:  # (a part of a file over MAX_PARTS parts)
            buf = bytearray(part)
        return buf, scratch

    def give(self, pair: tuple[bytearray, bytearray]) -> None:
        self._buffers.put(pair)

    def threads(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.parallel, thread_name_prefix="blockcache-upload")
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    def upload(self, rel: str, snap: Snapshot) -> FileInfo | None:
        """`snap`'s bytes as the object `rel`; its FileInfo (see `RemoteWrites`)."""
        size = snap.size
        if size <= self.part_bytes:
            buf = bytearray(size)
            snap.read_into(0, memoryview(buf), bytearray(snap.staged.stride))
            return self.remote.put(rel, memoryview(buf))
        part = part_size(size, self.part_bytes, self.remote.min_part)
        upload = self.remote.begin(rel)
        try:
            count = self.parts(upload, snap, part)
            return upload.complete(size, count)
        except BaseException:
            upload.abort()
            raise

    def parts(self, upload, snap: Snapshot, part: int,
              numbers: list[int] | None = None) -> int:
        """Parts `numbers` (default: every one) sent, at most `parallel` at
        once; the first failure raised. Returns the file's part count."""
        size = snap.size
        count = -(-size // part)
        failed = threading.Event()
        stride = snap.staged.stride

        def send(number: int) -> None:
            buf, scratch = self.take(part, stride)
            try:
                if failed.is_set():
                    return
                offset = (number - 1) * part
                view = memoryview(buf)[:min(part, size - offset)]
                snap.read_into(offset, view, scratch)
                upload.part(number, offset, view)
            except BaseException:
                failed.set()
                raise
            finally:
                self.give((buf, scratch))

        pool = self.threads()
        running: set[concurrent.futures.Future] = set()
        error: BaseException | None = None
        for number in (range(1, count + 1) if numbers is None else numbers):
            if len(running) >= self.parallel:
                done, running = concurrent.futures.wait(
                    running, return_when=concurrent.futures.FIRST_COMPLETED)
                error = error or _first_error(done)
            if error is not None or failed.is_set():
                break
            running.add(pool.submit(send, number))
        done, _ = concurrent.futures.wait(running)
        error = error or _first_error(done)
        if error is not None:
            raise error
        return count


def _first_error(done) -> BaseException | None:
    for fut in done:
        exc = fut.exception()
        if exc is not None:
            return exc
    return None
