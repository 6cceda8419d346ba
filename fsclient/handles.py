"""Open files and their read path, on the worker thread that took the request.

- `open` pins the FileInfo (the version) it saw; every read of that handle
  reads that version.
- A small file (up to WHOLE_FILE_MAX, within one block) is read whole. When
  its cache file is in the page cache it is read at open
  (its reader's `read_nowait`, which cannot wait on a disk) and, when no other
  handle of it is open, handed to the kernel's page cache before the open
  answers (`_store`), so its reads need no request. Otherwise its first read
  request reads it whole; later reads are slices of that.
- Every read goes through the handle's reader (`Volume.open_handle`: its
  version, its one sequential detector, the chunk path of random reads,
  read-ahead and the block files it holds), which waits only inside the
  session's `blocking` (the worker hands its channel on first), and only
  for what is not in memory: a warm read is answered without a wait, each
  chunk decrypted once.
- A sequential reader of a larger file has each read decrypted straight
  into a reply buffer reused from read to read (`replies`), outside the
  handle's lock, so two workers (`threads = 2`) serve two reads of one
  file at once; its reader prefetches the next `readahead_blocks` blocks,
  once per block crossed.
- A random read is answered with the whole chunks around its range
  (`FileHandle.read_around`); the chunks' other pages go to the kernel's
  page cache (`pagestore`).

Reads of one handle take its lock (the kernel may send several at once);
reads of different handles run side by side.

A read's answer lands in the inode's page cache, which the kernel keeps
across opens. Once an open of another version has been answered (it drops
that cache), an older handle's answer would put its version's bytes there
for the newer open to read. So an answer is written under the inode's
version lock (`answering`), which an open of another version takes to
record it before it answers: an older handle's read answered after that
gets ESTALE, as its reads of the source would.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from collections.abc import Callable

from blockcache_client import FileInfo, Volume
from blockcache_client.common.bufferpool import BufferPool
from blockcache_client.reader import FileHandle

from .config import MountConfig
from .handleids import HandleNumbers, file_tag, tag_of
from .inodes import InodeTable, Node
from .pagestore import ChunkStore
from .session import FuseError

log = logging.getLogger(__name__)

# A file up to this size (and within one block) is read whole at open: the
# read is under way while the open answer travels back, and one volume read
# costs less than the several 128 KiB pieces the kernel asks for. A miss
# fetches the whole block anyway, so this never costs an extra remote request.
WHOLE_FILE_MAX = 1 << 20
# A read this large continuing the last one is sequential at once (the
# kernel's readahead asks for 128 KiB and more); smaller ones from the third
# in a row. A handle's first read is not (the kernel reads ahead of any open).
SEQ_READ_MIN = 128 << 10
# How long a read waits for another read of its handle before the wait is
# handed off with its thread (see `_locked`): longer than a block's decrypt.
LOCK_WAIT = 0.01
# Reply buffers of sequential reads: the largest read the session asks the
# kernel for (`max_pages` 256), and the bytes of them kept for reuse.
REPLY_BYTES = 1 << 20
REPLY_BYTES_KEPT = 8 << 20
_VERSION_STRIPES = 64  # version locks (`answering`), inodes spread over them


class Handle:
    """An open file: the pinned FileInfo, its reader, its whole bytes if
    it is small, and the lock its reads take."""

    __slots__ = ("path", "info", "node", "inode", "data", "reader", "lock", "waits",
                 "generation")

    def __init__(self, path: str, info: FileInfo, inode: int, node: Node, reader: FileHandle,
                 generation: int = -1):
        self.path = path
        self.generation = generation  # the node's at open, for page-cache stores (`pagestore`)
        self.info = info
        self.inode = inode
        self.node = node  # its open count includes this handle until release
        self.data: memoryview | None = None  # the whole (small) file, once read
        # the open found it needs a wait (its no-wait read failed): a read
        # request reads it with no second try (the first try's readahead may
        # have brought the pages in, but not because they were warm)
        self.waits = False
        self.reader = reader  # the reader's open handle: every read of the file
        self.lock = threading.Lock()


class OpenFiles:
    """The mount's open file handles, and how their reads are served."""

    def __init__(self, volume: Volume, cfg: MountConfig, nodes: InodeTable):
        self.volume = volume
        self.cfg = cfg
        self.nodes = nodes
        self.handles: dict[int, Handle] = {}
        self._fh = HandleNumbers()  # numbers that name the version (see handleids)
        self._lock = threading.Lock()  # the counters below
        self.prefetches = 0
        self.kept_opens = 0  # opens that let the kernel keep its page cache
        self.inline_loads = 0  # whole-file reads that needed no wait
        self.stored_opens = 0  # opens that put the file's bytes in the page cache
        self.adopted = 0  # handles opened before this server, made again (`adopt`)
        self.stale_answers = 0  # reads of a version older than a later open's (`answering`)
        self._versions = [threading.Lock() for _ in range(_VERSION_STRIPES)]
        # puts small files' bytes in the kernel's page cache at open (`_store`):
        # the session's notify_store, set once a FUSE session exists
        self.store: Callable[[int, int, memoryview], None] | None = None
        # wraps a read that may wait (a miss, a disk read): the session's
        # `blocking`, which hands the worker's channel to another thread
        self.blocking: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.whole_file_max = min(WHOLE_FILE_MAX, cfg.block_size)
        # a small file put in the kernel's page cache at its open is read into
        # its thread's spare buffer: the kernel copies its bytes before the
        # open returns, and nothing keeps a view of it after
        self._spares = threading.local()
        # where sequential reads are decrypted and answered from: a buffer is
        # taken again only once no view of it is left (the reply written)
        self.replies = BufferPool(REPLY_BYTES, REPLY_BYTES_KEPT, page_aligned=True)
        # a random read's other pages of its chunks, into the kernel's page cache
        self.pages = ChunkStore()

    def __len__(self) -> int:
        return len(self.handles)

    def get(self, fh: int) -> Handle | None:
        return self.handles.get(fh)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def _spare(self, size: int) -> memoryview:
        spare = getattr(self._spares, "buf", None)
        if spare is None:
            spare = self._spares.buf = memoryview(bytearray(self.whole_file_max))
        return spare[:size]

    def open(self, path: str, info: FileInfo, inode: int, node: Node, keep: bool
             ) -> tuple[int, bool]:
        """A new handle of `path` pinned to `info`: (fh, keep_cache). `keep`
        says the kernel's pages of the inode already hold this version."""
        # the tag hashes the version: computed once per FileInfo the metadata
        # cache hands out, not at every open of it
        tag = node.tag
        if tag is None or tag[0] is not info:
            new = (info, file_tag(info))
            if tag is not None and tag[1] == new[1]:
                node.tag = new  # the same version, a FileInfo refreshed
            else:  # another version: no older handle's read is answered from now on
                with self._versions[inode % _VERSION_STRIPES]:
                    node.tag = new
            tag = new
        fh = self._fh.next(tag[1], self.handles)
        if keep:
            self._count("kept_opens")
        else:  # the kernel drops the inode's pages: no older open's store may land after
            self.pages.raise_generation(inode, node)
        h = self.handles[fh] = Handle(path, info, inode, node, self._reader(path, info),
                                      self.pages.generation_of(node, info.size))
        opens = self.nodes.opened(node)
        if 0 < info.size <= self.whole_file_max and not keep:
            # Safe to put in the page cache (see _store): read into the spare
            # buffer, whose bytes the kernel copies before this call returns.
            storable = self.store is not None and opens == 1 and node.size == info.size
            buf = self._spare(info.size) if storable else bytearray(info.size)
            data = self._load_nowait(h, buf)
            if data is None:
                h.waits = True  # the first read request reads it, on its own thread
            elif storable and self._store(inode, data):
                keep = True  # (keep_cache=False would drop the pages just stored)
            else:
                h.data = memoryview(bytes(data)) if storable else data
        return fh, keep

    def adopt(self, fh: int, path: str, info: FileInfo, inode: int, node: Node) -> Handle:
        """The handle `fh`, opened before this server took the mount over, made
        again from `info` (the source's version now); ESTALE if that is not the
        version it was opened on."""
        if tag_of(fh) != file_tag(info):
            raise FuseError(errno.ESTALE)
        with self._lock:
            h = self.handles.get(fh)
            if h is None:
                h = self.handles[fh] = Handle(path, info, inode, node, self._reader(path, info))
                self.adopted += 1
            else:
                return h
        self.nodes.opened(node)
        return h

    @contextlib.contextmanager
    def answering(self, fh: int, inode: int):
        """Held while the answer to a read of `fh` is written: FuseError
        ESTALE instead if an open of another version of the inode has been
        answered since `fh` was opened (see the module)."""
        with self._versions[inode % _VERSION_STRIPES]:
            h = self.handles.get(fh)
            tag = h.node.tag if h is not None else None
            if tag is not None and tag[1] != tag_of(fh):
                self._count("stale_answers")
                raise FuseError(errno.ESTALE)
            yield

    def _reader(self, path: str, info: FileInfo) -> FileHandle:
        """The reader's handle of a new open: a run starts at the second read
        in a row (the kernel's readahead reads the first), and prefetches the
        mount's `readahead_blocks`."""
        return self.volume.open_handle(path, info, seq_start=SEQ_READ_MIN, from_zero=False,
                                       ahead_blocks=self.cfg.readahead_blocks,
                                       on_ahead=self._ahead)

    def _ahead(self) -> None:
        self._count("prefetches")

    def release(self, fh: int) -> Handle | None:
        h = self.handles.pop(fh, None)
        if h is None:
            return None
        with h.lock:
            h.reader.close()
        return h

    def _load_nowait(self, h: Handle, buf: bytearray | memoryview) -> memoryview | None:
        """The whole (small) file, when the reader can read it without waiting:
        its block in the memory LRU, or its cache file's path and pages in the
        kernel's caches. None otherwise: an open then answers at once and the
        first read waits for the read."""
        view = memoryview(buf)
        try:
            n = h.reader.read_nowait(0, view)
        except Exception as exc:  # the blocking read reports real errors
            log.debug("no-wait read of %s: %s", h.path, exc)
            return None
        if n is None:
            return None
        self._count("inline_loads")
        return view[:n]

    def _store(self, inode: int, data: memoryview) -> bool:
        """Put a whole small file, read at its open, into the kernel's page
        cache for `inode` (FUSE notify_store), so the reader's reads are
        answered there, without a read request. True if stored: the open
        must then answer keep_cache, or the kernel drops the pages.

        The caller guarantees it is safe: no other handle of the inode is
        open (the kernel locks a page while a read of it waits for this
        process, and the store waits for that lock), and the kernel's size of
        the inode is this version's (every page it may serve, [0, size), now
        holds these bytes, so keeping them serves this version and nothing
        else); and that `store` is still set."""
        store = self.store
        if store is None:
            return False
        try:
            store(inode, 0, data)
        except OSError as exc:
            # failed, perhaps part way: this open answers without keep_cache,
            # so the kernel drops whatever was stored. Only a kernel without
            # the call turns it off; anything else (ENOMEM) is this file's
            if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP):
                self.store = None
                log.info("cannot put file data in the kernel's page cache (%s); small files "
                         "are read through read requests", exc)
            else:
                log.debug("notify_store of inode %d failed: %s", inode, exc)
            return False
        self._count("stored_opens")
        return True

    def read(self, fh: int, off: int, size: int, h: Handle | None = None) -> bytes | memoryview:
        h = h or self.handles.get(fh)
        if h is None:
            raise FuseError(errno.EBADF)
        avail = h.info.size - off
        if avail <= 0 or size <= 0:
            return b""
        size = min(size, avail)
        with self.pages.reading(h.inode, off, size):  # (no store waits on its pages)
            return self._read(h, off, size)

    def _read(self, h: Handle, off: int, size: int) -> bytes | memoryview:
        data = h.data
        if data is None and h.info.size <= self.whole_file_max:
            with self._locked(h):  # concurrent reads of it wait for the one whole-file read
                data = h.data
                if data is None:
                    buf = bytearray(h.info.size)
                    # (a kept open whose pages the kernel lost: first the same try)
                    data = None if h.waits else self._load_nowait(h, buf)
                    if data is None:  # (decrypted straight into `buf`, replies slices of it)
                        with self.blocking():
                            data = memoryview(buf)[:h.reader.read(0, len(buf), memoryview(buf))]
                    h.data = data
        if data is not None:
            return data[off:off + size]
        reader = h.reader
        with self._locked(h):
            if not reader.note(off, size) or size < reader.chunk_size:
                lo, data = reader.read_around(off, size, self.blocking)
                return self._chunks_read(h, lo, data, off, size)
        return self._read_stream(h, off, size)

    @contextlib.contextmanager
    def _locked(self, h: Handle):
        """`h.lock`. Another read of the handle holds it for a block's decrypt
        (a few ms at most: the kernel's readahead sends reads of one file at
        once), or for a miss: past LOCK_WAIT the wait counts as one
        (`blocking`)."""
        if not h.lock.acquire(timeout=LOCK_WAIT):
            with self.blocking():
                h.lock.acquire()
        try:
            yield
        finally:
            h.lock.release()

    def _chunks_read(self, h: Handle, lo: int, data: memoryview, off: int,
                     size: int) -> memoryview:
        """The read's [off, off+size) of `data` (the file at `lo`); the rest
        of it goes to the kernel's page cache (`pagestore`)."""
        if len(data) > size:
            self.pages.offer(h.inode, h.node, h.generation, h.info.size, lo, data,
                             off, off + size)
        return data[off - lo:off - lo + size]

    def _read_stream(self, h: Handle, off: int, size: int) -> memoryview:
        """[off, off+size) of a sequential reader, decrypted straight into a
        reply buffer (`replies`). Not under `h.lock`: the reader's reads are
        thread-safe and the handle's version is fixed. Blocks whose bytes are
        in memory are read without a wait; the first that is not, and the
        rest with it, in a wait (`blocking`). The view returned is the only
        one left of its buffer once this returns, so the buffer is reused
        only after the reply is written; a failed read raises and its
        buffer's bytes are never sent."""
        buf = self.replies.take() if size <= REPLY_BYTES else memoryview(bytearray(size))
        n = h.reader.read(off, size, buf[:size], self.blocking, noted=True)
        return buf[:n]
