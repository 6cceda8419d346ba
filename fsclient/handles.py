"""Open files and their read path.

- `open` pins the FileInfo (the version) it saw; every read of that handle
  reads that version.
- A small file (up to WHOLE_FILE_MAX, within one block) is read whole,
  starting at open, and served from the handle. When its cache file is in
  the page cache it is read at open on the loop (`Volume.readinto_nowait`,
  which cannot wait on a disk) and, when no other handle of it is open,
  handed to the kernel's page cache before the open answers (`_store`), so
  its reads need no request.
- A sequential reader of a larger file reads whole blocks into its handle
  (at most two per handle, BUFFER_BYTES_MAX over all) and prefetches the next
  `readahead_blocks` blocks, once per block crossed; random reads reset the
  streak, prefetch nothing, and read just their range.
Used on the event loop only; the reads themselves run on the pool.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging

import pyfuse3

from blockcache_client import Volume
from blockcache_client.reader.sequential import SEQ_SLACK, Stream
from blockcache_client.sources.fileinfo import FileInfo

from .config import MountConfig
from .inodes import Node
from .pool import LoopPool, log_prefetch_failure, retrieve

log = logging.getLogger("fsclient.fs")

# A file up to this size (and within one block) is read whole at open: the
# read is under way while the open answer travels back, and one volume read
# costs less than the several 128 KiB pieces the kernel asks for. A miss
# fetches the whole block anyway, so this never costs an extra remote request.
WHOLE_FILE_MAX = 1 << 20
# Bytes of whole blocks buffered for sequential readers, over all handles.
BUFFER_BYTES_MAX = 128 << 20


class Handle:
    """An open file: the pinned FileInfo and the sequential-read state."""

    __slots__ = ("path", "info", "node", "inode", "stream", "prefetched_until",
                 "data", "pending", "blocks")

    def __init__(self, path: str, info: FileInfo, inode: int, node: Node):
        self.path = path
        self.info = info
        self.inode = inode
        self.node = node  # its open count includes this handle until release
        self.data: memoryview | None = None  # the whole (small) file, once read
        self.pending: asyncio.Future | None = None  # ... while it is being read
        # block offset -> its bytes, for a sequential reader (made at its first
        # block: most handles are small files and never need one)
        self.blocks: dict[int, asyncio.Future] | None = None
        self.stream = Stream()  # the read pattern: sequential from the second read in a row
        self.prefetched_until = 0


class OpenFiles:
    """The mount's open file handles, and how their reads are served."""

    def __init__(self, volume: Volume, cfg: MountConfig, pool: LoopPool):
        self.volume = volume
        self.cfg = cfg
        self._pool = pool
        self.handles: dict[int, Handle] = {}
        self._fh = itertools.count(1)
        self.prefetches = 0
        self.inline_loads = 0  # whole-file reads served on the loop (no thread hop)
        self.stored_opens = 0  # opens that put the file's bytes in the page cache
        # put small files' bytes in the kernel's page cache at open (`_store`);
        # set by the mount once its FUSE session exists (never without one)
        self.store_pages = False
        self.whole_file_max = min(WHOLE_FILE_MAX, cfg.block_size)
        # a small file put in the kernel's page cache at its open is read into
        # this one buffer: the kernel copies its bytes before the open returns,
        # and nothing keeps a view of it after
        self._spare = memoryview(bytearray(self.whole_file_max))
        self.buffered_blocks = 0
        self.max_buffered_blocks = max(2, BUFFER_BYTES_MAX // cfg.block_size)

    def __len__(self) -> int:
        return len(self.handles)

    def get(self, fh: int) -> Handle | None:
        return self.handles.get(fh)

    def open(self, path: str, info: FileInfo, inode: int, node: Node, keep: bool
             ) -> tuple[int, bool]:
        """A new handle of `path` pinned to `info`: (fh, keep_cache). `keep`
        says the kernel's pages of the inode already hold this version."""
        fh = next(self._fh)
        h = self.handles[fh] = Handle(path, info, inode, node)
        node.opens += 1
        if 0 < info.size <= self.whole_file_max and not keep:
            # Safe to put in the page cache (see _store): read into the spare
            # buffer, whose bytes the kernel copies before this call returns.
            storable = self.store_pages and node.opens == 1 and node.size == info.size
            buf = self._spare[:info.size] if storable else bytearray(info.size)
            data = self._load_nowait(path, info, buf)
            if data is None:
                if storable:
                    buf = bytearray(info.size)  # the pool's read outlives this call
                h.pending = self._pool.call(self._load, path, 0, info.size, info, buf)
                h.pending.add_done_callback(retrieve)
            elif storable and self._store(inode, data):
                keep = True  # (keep_cache=False would drop the pages just stored)
            else:
                h.data = memoryview(bytes(data)) if storable else data
        return fh, keep

    def release(self, fh: int) -> Handle | None:
        h = self.handles.pop(fh, None)
        if h is not None and h.blocks:
            self.buffered_blocks -= len(h.blocks)
        return h

    def _load(self, path: str, off: int, size: int, info: FileInfo,
              buf: bytearray | memoryview | None = None) -> memoryview:
        """[off, off+size) of `path` (pinned to `info`) as a view of `buf` (a
        fresh buffer if None), on a pool thread: cached blocks decrypt straight
        into it, and replies to the kernel are slices of it, so the bytes are
        copied once from the cache file and once to the kernel, nothing more."""
        if buf is None:
            buf = bytearray(size)
        n = self.volume.readinto(path, off, buf, info=info)
        return memoryview(buf)[:n]

    def _load_nowait(self, path: str, info: FileInfo,
                     buf: bytearray | memoryview) -> memoryview | None:
        """The whole (small) file read here on the event loop, when the
        volume can do it without waiting: its block in the memory LRU, or its
        cache file's path and pages in the kernel's caches (`readinto_nowait`).
        A warm hit then costs no thread hop at all (two hops and the GIL
        handoffs around them cost several times the read itself); anything
        else returns None and goes to the pool, so a slow or hung cache disk
        still never blocks the loop. `buf` (info.size bytes) is left for
        the pool's read when this returns None."""
        try:
            n = self.volume.readinto_nowait(path, 0, buf, info=info)
        except Exception as exc:  # the pool's read reports real errors
            log.debug("inline read of %s: %s", path, exc)
            return None
        if n is None:
            return None
        self.inline_loads += 1
        return memoryview(buf)[:n]

    def _store(self, inode: int, data: memoryview) -> bool:
        """Put a whole small file, read at its open, into the kernel's page
        cache for `inode` (FUSE notify_store), so the reader's reads are
        answered there, without a read request. True if stored: the open
        must then answer keep_cache, or the kernel drops the pages.

        The caller guarantees it is safe: no other handle of the inode is
        open (the kernel locks a page while a read of it waits for this
        process, and the store waits for that lock: a store during such a
        read would never return), and the kernel's size of the inode is this
        version's (every page it may serve, [0, size), now holds these
        bytes, so keeping them serves this version and nothing else); and
        that `store_pages` is still on."""
        try:
            pyfuse3.notify_store(inode, 0, data)
        except OSError as exc:
            # failed, perhaps part way: this open answers without keep_cache,
            # so the kernel drops whatever was stored. Only a kernel without
            # the call turns it off; anything else (ENOMEM) is this file's
            if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP):
                self.store_pages = False
                log.info("cannot put file data in the kernel's page cache (%s); small files "
                         "are read through read requests", exc)
            else:
                log.debug("notify_store of inode %d failed: %s", inode, exc)
            return False
        self.stored_opens += 1
        return True

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        h = self.handles.get(fh)
        if h is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        avail = h.info.size - off
        if avail <= 0 or size <= 0:
            return b""
        size = min(size, avail)
        if h.data is None and h.pending is not None:
            pending = h.pending  # concurrent reads all wait for the one whole-file read
            try:
                h.data = await pending
            finally:
                if h.pending is pending:
                    h.pending = None  # done (or failed: the next read tries again)
        if h.data is None and h.info.size <= self.whole_file_max:
            # a kept open whose pages the kernel partly lost: the same inline try
            buf = bytearray(h.info.size)
            h.data = self._load_nowait(h.path, h.info, buf)
            if h.data is None:
                h.data = await self._pool.call(self._load, h.path, 0, h.info.size, h.info, buf)
        if h.data is not None:
            return h.data[off:off + size]
        sequential = self._follow(h, off, size)
        if (h.blocks is not None and (off - off % self.cfg.block_size) in h.blocks) or (
                sequential and self.buffered_blocks < self.max_buffered_blocks):
            return await self._read_blocks(h, off, size)
        return await self._pool.call(self._load, h.path, off, size, h.info)

    async def _read_blocks(self, h: Handle, off: int, size: int) -> bytes | memoryview:
        """Serve [off, off+size) from whole blocks read into the handle."""
        bs = self.cfg.block_size
        blocks = h.blocks
        if blocks is None:
            blocks = h.blocks = {}
        out = []
        while size > 0:
            boff = off - off % bs
            fut = blocks.get(boff)
            if fut is None:
                fut = self._pool.call(self._load, h.path, boff, min(bs, h.info.size - boff),
                                      h.info)
                fut.add_done_callback(retrieve)
                blocks[boff] = fut
                self.buffered_blocks += 1
                if len(blocks) > 2:
                    del blocks[next(iter(blocks))]
                    self.buffered_blocks -= 1
            try:
                data = await fut
            except BaseException:
                if blocks.get(boff) is fut:  # let the next read try again
                    del blocks[boff]
                    self.buffered_blocks -= 1
                raise
            piece = data[off - boff:off - boff + size]
            if not piece:
                break
            out.append(piece)
            off += len(piece)
            size -= len(piece)
        return out[0] if len(out) == 1 else b"".join(out)

    def _follow(self, h: Handle, off: int, size: int) -> bool:
        """Track the handle's read pattern; True if this read continues a
        sequential run. Sequential runs also prefetch the next blocks."""
        if not h.stream.advance(off, off + size, SEQ_SLACK):
            h.prefetched_until = 0
            return False
        if self.cfg.readahead_blocks:
            self._readahead(h, off)
        return True

    def _readahead(self, h: Handle, off: int) -> None:
        bs = self.cfg.block_size
        first = (off // bs + 1) * bs
        end = min(h.info.size, first + self.cfg.readahead_blocks * bs)
        start = max(first, h.prefetched_until)
        if start >= end:
            return
        h.prefetched_until = end
        self.prefetches += 1
        fut = self._pool.call(self.volume.prefetch, h.path, start, end - start, info=h.info)
        fut.add_done_callback(log_prefetch_failure)
