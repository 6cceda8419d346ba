"""The chunk cache: decrypted chunks of cached blocks, kept for small random reads.

Why: a 4 KiB read of a cached block decrypts the whole 64 KiB chunk around
it; LMDB, record files, Parquet pages and token windows read the same
chunks again and again. Decrypted chunks are kept in the memory LRU
(`blockmem`), under the one budget it shares with whole blocks.

Never stale: a chunk's key is (block key, header bytes, index). The header
holds the block's random salt, so a block evicted and filled again, with
whatever content, has another header, and its old chunks are never found.
A disk hit reads the header of the file in place (or holds the file open,
`blockfds`) before it looks chunks up. Plaintext this process fetched
itself is cached under the header it was sealed with (`sealed`): the chunks
its reads touched before the seal wait in the LRU under the empty header
(no file has it, so they are never served), and are kept under the real
one if the block sealed holds exactly their bytes there.

Only small partial reads keep chunks (`wants`): a whole-block read (a small
file), a large read, or one that starts where the last read of its block
ended (a stream, such as FUSE's 128 KiB requests) would only push blocks
out of the LRU. The block a miss fetched for such a read is transient
(`blockmem`): its chunks are what stays.
"""

from __future__ import annotations

import threading

from ..blockmem import BlockMemory
from ..contract.blockfile import chunk_span

CHUNKED_READ_MAX = 256 << 10  # larger reads stream: their chunks are not kept
PENDING_LIMIT = 4096          # blocks whose read chunks wait for their seal
UNSEALED = b""                # the header of chunks that wait for their block's seal
ENDS_LIMIT = 4096             # blocks whose last small read's end is remembered


class ChunkCache:
    """Decrypted chunks of one volume in one process, in the shared LRU `mem`."""

    def __init__(self, mem: BlockMemory, chunk_size: int, enabled: bool = True) -> None:
        self.mem = mem
        self.chunk_size = chunk_size
        # a budget that cannot hold a few chunks beside one block gains nothing
        self.enabled = bool(enabled) and mem.capacity > 0
        self._pending: dict[str, set[int]] = {}  # block key -> chunks read before its seal
        self._ends: dict[str, int] = {}  # block key -> where its last small read ended
        self._lock = threading.Lock()

    def wants(self, key: str, blen: int, lo: int, hi: int) -> bool:
        """Whether a read of [lo, hi) of `key`'s `blen`-byte block keeps its
        chunks. Racing threads can only make the guess worse, never a read wrong."""
        if not self.enabled or hi - lo >= blen or hi - lo > CHUNKED_READ_MAX:
            return False
        ends = self._ends
        if ends.get(key) == lo:  # continues the last read: a stream
            ends[key] = hi
            self.mem.not_transient(key)
            return False
        if len(ends) >= ENDS_LIMIT:
            ends.clear()
        ends[key] = hi
        return True

    def pieces(self, key: str, head: bytes, first: int, end: int) -> list[bytes | None]:
        """Chunks [first, end) of the block file with header `head` (None where not kept)."""
        get = self.mem.get
        return [get((key, head, i)) for i in range(first, end)]

    def keep(self, key: str, head: bytes, index: int, plain: bytes) -> None:
        self.mem.put((key, head, index), plain)

    def saw(self, key: str, data: bytes, head: bytes | None, lo: int, hi: int) -> None:
        """A read of [lo, hi) served from the block `data` in memory (sealed
        with `head`, None if not sealed yet): keep the chunks it touched."""
        c = self.chunk_size
        first, end = chunk_span(len(data), c, lo, hi - lo)
        if head is None:
            head = UNSEALED
            with self._lock:
                idx = self._pending.get(key)
                if idx is None:
                    if len(self._pending) >= PENDING_LIMIT:
                        self._pending.clear()
                    idx = self._pending[key] = set()
                idx.update(range(first, end))
        mem = self.mem
        for i in range(first, end):
            ck = (key, head, i)
            if mem.get(ck) is None:
                mem.put(ck, data[i * c:(i + 1) * c])

    def sealed(self, key: str, plaintext: bytes, head: bytes) -> None:
        """The block `plaintext` was sealed with `head` (the fill thread's
        `Sealer`): bind it if the LRU holds it, and keep the chunks reads
        touched before under `head`, those that are exactly its bytes."""
        if not self.enabled:
            return
        self.mem.bind_head(key, plaintext, head)
        with self._lock:
            idx = self._pending.pop(key, None)
        c = self.chunk_size
        for i in sorted(idx or ()):
            chunk = self.mem.pop((key, UNSEALED, i))
            # another fetch of this key may have left these (a file that
            # changed without a new version): only the same bytes are kept
            if chunk is not None and chunk == plaintext[i * c:(i + 1) * c]:
                self.mem.put((key, head, i), chunk)


def cut(piece: bytes, skip: int, n: int, out: memoryview | None):
    """piece[skip:skip + n] as bytes, or stored in `out` and its length returned."""
    if out is None:
        return piece[skip:skip + n]
    out[:n] = memoryview(piece)[skip:skip + n]
    return n


def assemble(pieces: list[bytes], first: int, chunk_size: int, lo: int, hi: int,
             out: memoryview | None):
    """Plaintext [lo, hi) of a block from its chunks `first`.. (`pieces`): as
    bytes, or stored in `out` and its length returned."""
    skip = lo - first * chunk_size
    n = hi - lo
    if len(pieces) == 1:
        return cut(pieces[0], skip, n, out)
    views = []
    left = n
    for p in pieces:
        piece = memoryview(p)[skip:skip + left]
        views.append(piece)
        left -= len(piece)
        skip = 0
    if out is None:
        return b"".join(views)
    pos = 0
    for piece in views:
        out[pos:pos + len(piece)] = piece
        pos += len(piece)
    return n
