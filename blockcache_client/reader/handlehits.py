"""An open handle's block files, and the short path of its repeat chunk hits.

Why: a warm small read through a held `VolumeFile` walks the whole read path
(the version's key prefix, the sequential detector, `chunks.wants`, the
hit reader, a borrow of the block file under the table's lock) only to end
in a dict lookup and a copy. The handle is pinned to one file version, so
once one of its reads went through the chunk cache (`chunkhits`), it
remembers that block's key and open file (`blockfds.OpenBlock`, with the
header its chunks are kept under); the next read of that block is served
here: one fstat, one lookup of its pages or chunks in the LRU, one copy.

Never stale: the fstat is the table's revalidation (a block file evicted or
replaced has no link left), and an entry the table has let go of (`doomed`,
checked after the fstat, so its descriptor number was not yet closed and
reused when the fstat ran) is forgotten. Anything else (a chunk not kept, a
read across blocks or larger than `CHUNKED_READ_MAX`, no daemon, a forked or
closed volume) returns None and takes the full path, which counts, decrypts,
judges and remembers again.

Reads served here need no fetch, so the sequential detector does not see
them: a stream that reaches blocks not held is detected anew there.
"""

from __future__ import annotations

import os

from ..common.forks import generation as _forks
from ..fileinfo import FileInfo
from .blockfds import OpenBlock
from .chunks import CHUNKED_READ_MAX, PAGE, PAGE_READ_MAX, assemble, cut


class HandleBlocks:
    """The block files one open handle uses: the owner set of `blockfds` and
    the open file of each block it read through the chunk cache."""

    __slots__ = ("keys", "open", "_volume", "_rel", "_info", "_names")

    def __init__(self, volume, rel: str, info: FileInfo) -> None:
        self.keys: set[str] = set()  # block files the table keeps open for this handle
        self.open: dict[str, OpenBlock] = {}  # block key -> the open file its chunks are under
        self._volume = volume
        self._rel = rel
        self._info = info
        self._names: dict[int, str] = {}  # block index -> block key (one version)

    def remember(self, key: str, ent: OpenBlock) -> None:
        """A chunked read of `key` succeeded with the open file `ent`."""
        self.open[key] = ent

    def forget(self, key: str) -> None:
        self.open.pop(key, None)

    def read(self, pos: int, size: int, out: memoryview | None):
        """Bytes [pos, pos + size) of the file (or their count, stored in
        `out`) from chunks kept in memory, counted as a chunk hit; None if
        the full read path must decide (nothing counted then)."""
        vol = self._volume
        if not self.open or vol._fork_gen != _forks[0] or vol._closed or size > CHUNKED_READ_MAX:
            return None
        end = pos + size
        if end > self._info.size:
            end = self._info.size
        bs = vol.block_size
        b = pos // bs
        if pos >= end or (end - 1) // bs != b:
            return None
        key = self._names.get(b)
        if key is None:
            key = vol._key_prefix(self._rel, self._info.version) + format(b * bs, "016x")
            self._names[b] = key
        ent = self.open.get(key)
        hits = vol._hits
        if ent is None or hits.link.layout is None:  # no daemon: misses, as on the full path
            return None
        try:
            linked = os.fstat(ent.fd).st_nlink
        except OSError:
            linked = 0
        if ent.doomed or not linked:  # doomed: the fstat may have seen a reused number
            self.open.pop(key, None)
            return None
        lo = pos - b * bs
        if size <= PAGE_READ_MAX:  # a small read keeps its pages (`chunks`)
            c, page = PAGE, PAGE
        else:
            c, page = hits.chunk_size, 0
        first = lo // c
        pieces = hits.mem.get_pieces(key, ent.head, first, (end - 1 - b * bs) // c + 1, page)
        if pieces is None:
            return None
        hits.counters.chunk_hit(end - pos)
        link = hits.link
        seen = link.touch_round  # read first: a batch taken meanwhile gets the key again
        if ent.touched != seen:  # one report per block file per batch is enough
            link.touch(key)
            ent.touched = seen
        if len(pieces) == 1:
            return cut(pieces[0], lo - first * c, end - pos, out)
        return assemble(pieces, first, c, lo, lo + end - pos, out)

    def close(self, files) -> None:
        """The handle closed: `files` (the volume's `BlockFiles`) may close
        the block files no other handle uses."""
        self.open.clear()
        if self.keys:
            files.disown(self.keys)
