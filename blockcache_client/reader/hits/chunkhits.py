"""Small partial hits of cached blocks through the chunk cache.

`HitReader` sends here the reads `ChunkCache.wants` (small, not a whole
block, not a nowait probe). The block file is the one a handle holds open
(`blockfds`, revalidated) or opened for this read; its header names the
pieces kept (`chunks`): those are served from memory, else the chunks the
read touches are read with one pread, decrypted, and what the read keeps
of them is kept. Judged like every hit (`hits`): a missing file is a miss,
a bad one is evicted through the daemon. A `nowait` read opens and reads
only from the kernel's caches (`hits`): where that is not enough it is
None, nothing judged, and the caller's blocking read decides.

A chunk in memory was authenticated when it was decrypted (or was sealed by
this process): as long as the file in place carries the same header, it is
the same block, and serving the chunk is right even if bytes of the file
were damaged since.
"""

from __future__ import annotations

import errno
import logging
import os

from ...common.nowait import Unsupported
from ...common.nowait import open_cached as nowait_open
from ...contract.blockfile import HEADER_SIZE, TAG_SIZE, file_size
from ...contract.errors import FormatError, IntegrityError
from ...contract.layout import Layout
from .blockfds import BlockFiles, Holder, OpenBlock
from .blockhits import O_BLOCK_FILE, HitReader, check_block_stat
from .chunks import ChunkCache, assemble, cut, lookup

log = logging.getLogger(__name__)


class ChunkedHits:
    """The chunk cache's side of the hit path, for one volume in one process."""

    def __init__(self, hits: HitReader, cache: ChunkCache, files: BlockFiles):
        self._chunk_size = hits.chunk_size
        self._link = hits.link
        self._cipher = hits.ciphers.cipher
        self.counters = hits.counters
        self._bad_block = hits.bad_block
        self._hits = hits  # whether the kernel reads without waiting (`HitReader.nowait`)
        self.cache = cache
        self.files = files
        self._peek = cache.mem.peek

    def fetched(self, key: str, data: bytes, lo: int, hi: int) -> None:
        """A miss read [lo, hi) of the block `data` it fetched: its chunks are
        kept now if the block was sealed already (a small one, inline), else
        once it is."""
        held, head = self.cache.mem.get_bound(key)
        self.cache.saw(key, data, head if held is data else None, lo, hi)

    def read(self, layout: Layout, key: str, blen: int, lo: int, hi: int,
             out: memoryview | None, holder: Holder | None, nowait: bool = False):
        """Plaintext [lo, hi) (lo < hi <= blen) of `key`'s cached block
        (bytes, or the length stored in `out`), or None for a miss; a hit is
        counted and touched. `holder`: an open handle's blocks; the handle
        keeps the block file open and remembers it (`handlehits`)."""
        c = self._chunk_size
        first, end = lo // c, (hi - 1) // c + 1
        ent = self.files.borrow(key, holder.keys) if holder is not None else None
        mine = -1  # a descriptor this read opened and must close (not the table's)
        try:
            if ent is not None:
                fd, head, size = ent.fd, ent.head, ent.size
            else:
                path = layout.path(key)
                if path is None:  # its cache dir is unhealthy
                    return None
                fd, head, size = self._open(path, key, nowait)
                if fd < 0:
                    return None
                if holder is None:
                    mine = fd
                else:
                    ent = self.files.adopt(key, fd, head, size, holder.keys)
            if holder is not None:
                holder.remember(key, ent)
            found = lookup(self._peek, key, head, blen, c, lo, hi)
            if found is not None:
                self.counters.add3("hits", "hit_bytes", hi - lo, "chunk_hits")
                self._link.touch(key)
                return assemble(found[0], found[1], lo, hi, out)
            plain = self._decrypt(fd, key, head, size, blen, first, end, nowait)
            if plain is None:  # pages not all in memory: the blocking read decides
                return None
            self.cache.keep(key, head, blen, plain, first * c, lo, hi)
            self.counters.add2("hits", "hit_bytes", hi - lo)
            self._link.touch(key)
            return cut(plain, lo - first * c, hi - lo, out)
        except (FormatError, IntegrityError, OSError) as exc:
            if nowait:  # judged once, by the blocking read that follows
                if isinstance(exc, Unsupported) or getattr(exc, "errno", None) in (
                        errno.EOPNOTSUPP, errno.EINVAL):
                    self._hits.nowait_refused(exc)
                return None
            if ent is not None:  # stale or bad: not lent again
                self.files.give_back(ent, drop=True)
                holder.forget(key)
                ent = None
            if isinstance(exc, OSError):  # a failing cache disk is a miss, never an error
                log.debug("cannot read cached block %s: %s", key, exc)
            else:
                self._bad_block(key, exc)
            return None
        finally:
            if ent is not None:
                self.files.give_back(ent)
            elif mine >= 0:
                os.close(mine)

    def hold(self, key: str, head: bytes, holder: Holder) -> OpenBlock | None:
        """A handle read `key`'s block from memory, or fetched it, and this
        process sealed it with `head`: once its fill has landed (the file in
        place has that header), keep the file open for the handle, so its
        next reads of the block, the next epoch's too, take the short path
        (`handlehits`). The entry kept, or None."""
        layout = self._link.layout
        path = layout.path(key) if layout is not None else None
        if path is None:
            return None
        try:
            fd, disk_head, size = self._open(path, key)
        except (FormatError, OSError):  # judged by the reads that need the file
            return None
        if fd < 0:
            return None
        if disk_head != head:  # another fill won: its pieces are not these
            os.close(fd)
            return None
        ent = self.files.adopt(key, fd, head, size, holder.keys)
        holder.remember(key, ent)
        self.files.give_back(ent)
        return ent

    def _open(self, path: str, key: str, nowait: bool = False) -> tuple[int, bytes, int]:
        """(fd, header bytes, file size) of the block file at `path`; fd -1
        if there is none (or, `nowait`, if its path or header is not in the
        kernel's caches). FormatError (after closing it) for a file that is
        not the daemon's regular file, or whose header is short."""
        try:
            fd = nowait_open(path, O_BLOCK_FILE) if nowait else os.open(path, O_BLOCK_FILE)
        except FileNotFoundError:
            return -1, b"", 0
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink in the cache tree
                raise FormatError(f"a symlink on its path {path}") from None
            raise
        try:
            st = os.fstat(fd)
            check_block_stat(st, self._link.daemon_uid, path)
            if nowait:
                head = bytearray(HEADER_SIZE)
                got = os.preadv(fd, [head], 0, os.RWF_NOWAIT)
                if got != HEADER_SIZE:
                    os.close(fd)
                    return -1, b"", 0
                head = bytes(head)
            else:
                head = os.pread(fd, HEADER_SIZE, 0)
            if len(head) != HEADER_SIZE:
                raise FormatError(f"block file {path} is {st.st_size} bytes: no whole header")
        except BaseException:
            os.close(fd)
            raise
        return fd, head, st.st_size

    def _decrypt(self, fd: int, key: str, head: bytes, size: int, blen: int, first: int,
                 end: int, nowait: bool = False) -> bytes | None:
        """The plaintext of chunks [first, end), read with one pread and
        authenticated; None if `nowait` and its pages are not all in memory."""
        c = self._chunk_size
        cipher = self._cipher(key, head, blen)
        want = file_size(blen, c)
        if size != want:
            raise FormatError(f"block file is {size} bytes; its header says {want}")
        step = c + TAG_SIZE
        start = HEADER_SIZE + first * step
        want = min(size, HEADER_SIZE + end * step) - start
        if nowait:
            data = bytearray(want)
            if os.preadv(fd, [data], start, os.RWF_NOWAIT) != want:
                return None
        else:
            data = os.pread(fd, want, start)
        self.counters.add("chunks_decrypted", end - first)
        return cipher.open_chunks(first, end, data)
