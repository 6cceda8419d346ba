"""An open handle's block files, and the short path of its repeat chunk hits.

Why: a warm small read through a held `VolumeFile` walks the whole read path
(the version's key prefix, the sequential detector, `chunks.wants`, the
hit reader, a borrow of the block file under the table's lock) only to end
in a dict lookup and a copy. The handle is pinned to one file version, so
once one of its reads went through the chunk cache (`chunkhits`), or it
read the block from memory or fetched it and this process's fill of it
has landed (`ChunkedHits.hold`), it remembers that block's open file by
block index (`blockfds.OpenBlock`, with its key and the header its pieces
are kept under); the next read of that block is served here: one fstat,
one lookup of its pieces in the LRU (an aligned read of what a read
before kept is that very bytes object, no copy).

Never stale: the fstat is the table's revalidation (a block file evicted or
replaced has no link left), and an entry the table has let go of (`doomed`,
checked after the fstat, so its descriptor number was not yet closed and
reused when the fstat ran) is forgotten. Anything else (a piece not kept, a
read across blocks or larger than `CHUNKED_READ_MAX`, no daemon) returns
None and takes the full path, which counts, decrypts, judges and remembers
again. The handle (`handle`) makes a new one in a forked child.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ...sources.fileinfo import FileInfo
from ..options import WRITE_WAIT
from .blockfds import BlockFiles, OpenBlock
from .blockhits import HitReader
from .chunks import CHUNKED_READ_MAX, PAGE, assemble, cut, lookup


class HandleBlocks:
    """The block files one open handle uses: the owner set of `blockfds` and
    the open file of each block it read through the chunk cache."""

    __slots__ = ("keys", "open", "fetched", "_given_up", "_hits", "_key_prefix", "_rel",
                 "_version", "_size", "_block_size")

    def __init__(self, hits: HitReader, key_prefix: Callable[[str, str], str],
                 block_size: int, rel: str, info: FileInfo) -> None:
        """`key_prefix(path, version)`: the version's block key prefix."""
        self.keys: set[str] = set()  # block files the table keeps open for this handle
        # block index -> the open file its chunks are under (one version: the
        # index names the block)
        self.open: dict[int, OpenBlock] = {}
        # blocks fetched or read from memory whose files are not held yet ->
        # when their fill is taken as lost, if it has not landed by then
        self.fetched: dict[int, float] = {}
        # blocks whose files are not to be held: another fill's is in place,
        # or ours never landed (each read would try again in vain)
        self._given_up: set[int] = set()
        self._hits = hits
        self._key_prefix = key_prefix
        self._rel = rel
        self._version = info.version
        self._size = info.size
        self._block_size = block_size

    def remember(self, key: str, ent: OpenBlock) -> None:
        """A chunked read of `key` succeeded with the open file `ent`."""
        self.open[self._index(key)] = ent

    def forget(self, key: str) -> None:
        self.open.pop(self._index(key), None)

    def _index(self, key: str) -> int:
        """The block index a key of this file names (its last field: the offset)."""
        return int(key[-16:], 16) // self._block_size

    def expect(self, b: int) -> None:
        """This handle's miss fetched block `b`: hold its file once the fill lands."""
        self._given_up.discard(b)  # a new fetch, a new fill
        if b not in self.open:
            self.fetched.setdefault(b, time.monotonic() + WRITE_WAIT)

    def hold_bound(self, key: str, head: bytes) -> None:
        """The handle read `key`'s block from memory, where it is bound to
        the header `head` this process sealed it with: hold its file now if
        that fill has landed, else at a later read (`_hold`)."""
        b = self._index(key)
        if b in self.open or b in self._given_up:
            return
        self.fetched.setdefault(b, time.monotonic() + WRITE_WAIT)
        self._hold(b, key, head)

    def read(self, pos: int, size: int, out: memoryview | None):
        """Bytes [pos, pos + size) of the file (or their count, stored in
        `out`) from pages or chunks kept in memory, counted as a chunk hit;
        None if the full read path must decide (nothing counted then)."""
        if not (self.open or self.fetched) or size > CHUNKED_READ_MAX:
            return None
        end = pos + size
        if end > self._size:
            end = self._size
        bs = self._block_size
        b = pos // bs
        if pos >= end or (end - 1) // bs != b:
            return None
        ent = self.open.get(b)
        if ent is None:
            if b not in self.fetched:
                return None
            ent = self._hold(b)
            if ent is None:
                return None
        hits = self._hits
        link = hits.link
        if link.layout is None:  # no daemon: misses, as on the full path
            return None
        try:
            linked = os.fstat(ent.fd).st_nlink
        except OSError:
            linked = 0
        if ent.doomed or not linked:  # doomed: the fstat may have seen a reused number
            self.open.pop(b, None)
            return None
        boff = b * bs
        lo, hi = pos - boff, end - boff
        blen = self._size - boff
        if blen > bs:
            blen = bs
        start = lo - lo % PAGE
        piece = None
        if hi - start <= PAGE:  # within one page: `chunks.lookup`'s usual case, inline
            stop = start + PAGE
            piece = hits.mem.peek((ent.key, ent.head, start, stop if stop < blen else blen))
        if piece is None:
            found = lookup(hits.mem.peek, ent.key, ent.head, blen, hits.chunk_size, lo, hi)
            if found is None:
                return None
        hits.counters.chunk_hit(hi - lo)
        seen = link.touch_round  # read first: a batch taken meanwhile gets the key again
        if ent.touched != seen:  # one report per block file per batch is enough
            link.touch(ent.key)
            ent.touched = seen
        if piece is not None:
            return cut(piece, lo - start, hi - lo, out)
        return assemble(found[0], found[1], lo, hi, out)

    def _hold(self, b: int, key: str | None = None,
              head: bytes | None = None) -> OpenBlock | None:
        """The file of block `b` (`fetched`), held now if this process's fill
        of it, sealed with `head` (by default the one `sealed_head` knows),
        has landed (`ChunkedHits.hold`). A block not sealed here is not tried
        again; one whose fill lost to another's file, or has not landed by its
        time, is given up; one whose fill is on its way is tried at the next read."""
        hits = self._hits
        chunks = hits.chunks
        if key is None:
            key = self._key_prefix(self._rel, self._version) + format(
                b * self._block_size, "016x")
        if head is None and chunks is not None:
            head = chunks.cache.sealed_head(key)
        ent = chunks.hold(key, head, self) if head is not None else None
        if ent is not None or head is None:
            self.fetched.pop(b, None)
        elif hits.is_cached(key) or time.monotonic() > self.fetched.get(b, 0.0):
            self.fetched.pop(b, None)
            self._given_up.add(b)
        return ent

    def close(self, files: BlockFiles) -> None:
        """The handle closed: `files` (the volume's `BlockFiles`) may close
        the block files no other handle uses."""
        self.open.clear()
        self.fetched.clear()
        self._given_up.clear()
        if self.keys:
            files.disown(self.keys)
