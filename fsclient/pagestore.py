"""The rest of a decrypted chunk, handed to the kernel's page cache.

A random read decrypts the whole 64 KiB chunk around its range (the unit
blocks are sealed in); the kernel asked for one page of it. `ChunkStore`
puts the chunk's other pages into the kernel's page cache of the inode
(FUSE notify_store), so later reads of them are answered by the kernel with
no request: one decrypt serves 16 pages.

The stores run on one thread of their own, never on a worker: the kernel
locks a page while a read of it waits for this process, and a store of that
page waits for the lock until a worker answers the read. A worker that
waited so could wait for itself; the store thread only waits for workers.
A store is best effort: at most QUEUE_MAX wait, the rest are dropped.

That wait must end, and must not pin the server: a page's lock is released
when its read is answered (or the connection ends), and a store can wait
for a read still queued in the kernel that no worker has taken. So the
stores are written by a child process (`session.storer`), which the store
thread hands one store at a time: a server killed while a store waits
exits at once, its keeper starts the next server, whose answer to that
read lets the store (and then the child, killed with its parent) end. A
store is also skipped while a read request the workers hold overlaps its
range (`reading`): it would only wait for that read.

**Never a stale page.** The kernel keeps one page cache per inode across
opens; an open that answers without keep_cache (another version, or a TTL
of 0) has it dropped when the open completes. A store of the old version's
bytes landing after that drop would be served to the new open. So each
`Node` has a generation, raised (under its stripe lock, before the kernel
hears the answer) by every open without keep_cache and every change of the
size the kernel is told; a handle remembers the generation of its open (or
-1: no stores, when the kernel's size is not its version's), and a store
checks it and writes under the same lock. A store either completes before
the raise, so before the answer that drops the cache, or sees the raise and
is skipped. Stores never reach past the version's size (notify_store would
grow the kernel's size to the store's end).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import threading
from collections.abc import Callable

from .inodes import Node
from .session.storer import Storer, await_predecessors

log = logging.getLogger(__name__)

# Stores waiting for the store thread, at most: past that an offer is dropped
# (the kernel just asks for those pages when they are read).
QUEUE_MAX = 256
# How long a generation raise waits for a store of the inode before the wait
# is handed off with its thread (`blocking`): a store may wait on a page lock.
LOCK_WAIT = 0.01
_STRIPES = 64
PAGE = 4096


class ChunkStore:
    """Puts the pages around a read into the kernel's page cache, off the
    request's thread, never after a newer version's open (see the module)."""

    def __init__(self) -> None:
        # notify_store (nodeid, offset, data) through the child (`enable`); None: off
        self.store: Callable[[int, int, memoryview], None] | None = None
        self._fuse_fd: Callable[[], int] = lambda: -1
        self._saved_fd = -1
        self._storer: Storer | None = None  # started by the first store or notification
        self._stopped = False
        # set once no earlier server's store can land (`await_predecessors`)
        self._predecessors_gone = threading.Event()
        self._predecessors_gone.set()
        # the session's `blocking`: a raise that waits hands its channel on
        self.blocking: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self._locks = [threading.Lock() for _ in range(_STRIPES)]
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        # inode -> [off, end) of the read requests being answered (`reading`)
        self._reads: dict[int, list[tuple[int, int]]] = {}
        self._reads_lock = threading.Lock()  # (never held across I/O)
        self._writing = threading.Lock()  # held by the store thread while it writes
        self.stored_pages = 0  # pages handed to the kernel
        self.skipped = 0  # stores refused: a newer open or size since (or the queue full)

    def connect(self, fuse_fd: Callable[[], int], saved_fd: int) -> None:
        """Notifications go through a child writing on `fuse_fd()` (a
        descriptor of the connection, once it serves), started at the first;
        `saved_fd`: the mount's saved-state memfd, the child holds a lock on."""
        self._fuse_fd, self._saved_fd = fuse_fd, saved_fd

    def enable(self, fuse_fd: Callable[[], int], saved_fd: int) -> None:
        """Store from now on, through the child (`connect`)."""
        self.connect(fuse_fd, saved_fd)
        self.store = self._store_by_child

    def notify(self, code: int, body: bytes) -> None:
        """Any other notification, written by the same child (`Storer.notify`):
        one that may wait in the kernel never pins this process."""
        self._child().notify(code, body)

    def _store_by_child(self, nodeid: int, offset: int, data: memoryview) -> None:
        self._child().store(nodeid, offset, data)

    def _child(self) -> Storer:
        with self._start:
            if self._stopped or self._saved_fd < 0:
                raise OSError(errno.EPIPE, "the page-store process has stopped")
            if self._storer is None:
                try:
                    self._storer = Storer(self._fuse_fd(), self._saved_fd)
                except OSError as exc:  # (EPIPE: `_write` turns the store off)
                    raise OSError(errno.EPIPE, f"cannot start the page-store process: "
                                               f"{exc}") from exc
            return self._storer

    def await_predecessors(self, saved_fd: int) -> None:
        """Hold every generation raise until no store of an earlier server
        of the mount can land (`storer.await_predecessors`), on a thread: its
        child may wait for a read this server is to answer."""
        self._predecessors_gone.clear()

        def wait() -> None:
            try:
                await_predecessors(saved_fd)
            except OSError as exc:
                log.warning("cannot tell whether an earlier server's page-cache store "
                            "is left (%s); going on", exc)
            self._predecessors_gone.set()

        threading.Thread(target=wait, daemon=True, name="fuse-store-predecessors").start()

    def _lock(self, inode: int) -> threading.Lock:
        return self._locks[inode % _STRIPES]

    def raise_generation(self, inode: int, node: Node) -> None:
        """A new version of `inode` for the kernel (an open without
        keep_cache, a new size): no store of an older open lands after this."""
        if not self._predecessors_gone.is_set():
            with self.blocking():
                self._predecessors_gone.wait()
        lock = self._lock(inode)
        if not lock.acquire(timeout=LOCK_WAIT):
            with self.blocking():
                lock.acquire()
        try:
            node.generation += 1
        finally:
            lock.release()

    @staticmethod
    def generation_of(node: Node, size: int) -> int:
        """The generation a new open of a version of `size` bytes stores under:
        -1 (never) if the kernel's size of the inode is another."""
        generation = node.generation  # (read first: a size change after it raises it)
        return generation if node.size == size else -1

    def offer(self, inode: int, node: Node, generation: int, size: int,
              lo: int, data: memoryview, skip_lo: int, skip_hi: int) -> None:
        """Store `data` (the file's bytes at `lo`, never changed later) but
        the pages [skip_lo, skip_hi) the read answers itself, if `generation`
        is still the node's when it is written. `size`: the version's size."""
        if self.store is None or generation < 0:
            return
        if generation != node.generation or len(self._queue) >= QUEUE_MAX:
            self.skipped += 1
            return
        hi = min(lo + len(data), size)
        skip_lo -= skip_lo % PAGE
        skip_hi = min(hi, skip_hi + -skip_hi % PAGE)
        parts = [(a, b) for a, b in ((lo, skip_lo), (skip_hi, hi)) if b > a]
        if not parts:
            return
        self._queue.append((inode, node, generation, lo, data, parts))
        if self._thread is None:
            self._run_thread()
        self._wake.set()

    @contextlib.contextmanager
    def reading(self, inode: int, off: int, size: int):
        """Around the handling of a read request of [off, off+size): the
        kernel holds those pages locked until it is answered."""
        span = (off, off + size)
        with self._reads_lock:
            self._reads.setdefault(inode, []).append(span)
        try:
            yield
        finally:
            with self._reads_lock:
                spans = self._reads[inode]
                spans.remove(span)
                if not spans:
                    del self._reads[inode]

    def _overlaps_reads(self, inode: int, lo: int, hi: int) -> bool:
        with self._reads_lock:
            return any(a < hi and lo < b for a, b in self._reads.get(inode, ()))

    def stop(self, timeout: float = 1.0) -> None:
        """No more stores; waits (at most `timeout`) for one being written,
        which the workers, still serving, let finish; then ends the child."""
        self.store = None
        if self._writing.acquire(timeout=timeout):
            self._writing.release()
        with self._start:
            self._stopped = True
            storer, self._storer = self._storer, None
        if storer is not None:
            storer.close()

    def _run_thread(self) -> None:
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="fuse-page-store")
                self._thread.start()

    def _run(self) -> None:
        queue = self._queue
        while True:
            self._wake.wait()
            self._wake.clear()
            while queue:
                try:
                    with self._writing:
                        self._write(*queue.popleft())
                except Exception:
                    log.exception("page-cache store failed; reads are unaffected")

    def _write(self, inode: int, node: Node, generation: int, lo: int, data: memoryview,
               parts: list[tuple[int, int]]) -> None:
        store = self.store
        if store is None:
            return
        with self._lock(inode):
            if node.generation != generation or self._overlaps_reads(inode, lo, lo + len(data)):
                self.skipped += 1
                return
            stored = 0
            try:
                for a, b in parts:
                    store(inode, a, data[a - lo:b - lo])
                    stored += (b - a + PAGE - 1) // PAGE
            except OSError as exc:
                if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPIPE):
                    self.store = None
                    log.warning("cannot put file data in the kernel's page cache (%s); "
                                "random reads store no neighbouring pages", exc)
                elif exc.errno != errno.ENOENT:  # (ENOENT: the kernel forgot the inode)
                    log.debug("notify_store of inode %d failed: %s", inode, exc)
            finally:
                self.stored_pages += stored  # once a store: a reader sees all its parts
