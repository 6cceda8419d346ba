"""The chunk cache: decrypted plaintext of cached blocks, kept for small random reads.

Why: a 4 KiB read of a cached block decrypts the whole 64 KiB chunk around
it; LMDB, record files, Parquet pages and token windows read the same
chunks again and again. Their plaintext is kept in the memory LRU
(`memory`), under the one budget it shares with whole blocks.

What a read keeps (`spans`), keyed by its byte range in the block's
plaintext, (block key, header bytes, start, stop):
- a read of at most `PAGE_READ_MAX` bytes (an LMDB page, a record header):
  the `PAGE`-sized pages it touches. Whole 64 KiB chunks for 4 KiB random
  reads would hold 16 times the bytes read, so a budget that holds an
  epoch's pages would hold a sixteenth of its chunks, and each epoch would
  decrypt again what the one before pushed out;
- a larger one: the chunks it touches, as one piece (a run). A read of
  whole chunks (an aligned 128 KiB record) read again is that very bytes
  object, served without a copy.
A read looks for the same pieces (`lookup`); a small read whose pages are
not kept also takes the run of the one chunk around it, if a larger read
kept that.

Never stale: the key holds the block file's header, whose salt is random
per fill, so a block evicted and filled again, with whatever content, has
another header, and its old pieces are never found. A disk hit reads the
header of the file in place (or holds the file open, `blockfds`) before it
looks pieces up. Plaintext this process fetched itself is cached under the
header it was sealed with (`sealed`): the pieces its reads touched before
the seal wait in the LRU under the empty header (no file has it, so they
are never served), and are kept under the real one if the block sealed
holds exactly their bytes there.

Only small partial reads keep anything (`wants`): a whole-block read (a
small file), a large read, or the third of a run of reads each starting
where the last one of its block ended (a stream, such as FUSE's 128 KiB
requests) would only push blocks out of the LRU. Two in a row are not a
stream: random reads at aligned offsets meet by chance, and each epoch
would decrypt the second again. The block a miss fetched for such a read is
transient (`memory`): its pieces are what stays.
"""

from __future__ import annotations

import threading

from ...contract.blockfile import MIN_CHUNK
from .memory import BlockMemory

CHUNKED_READ_MAX = 256 << 10  # larger reads stream: their chunks are not kept
PENDING_LIMIT = 4096          # blocks whose read pieces (and sealed headers) are remembered
UNSEALED = b""                # the header of pieces that wait for their block's seal
ENDS_LIMIT = 4096             # blocks whose last small read's end is remembered
PAGE = MIN_CHUNK              # what a small read keeps: its pages (they divide every chunk)
PAGE_READ_MAX = 16 << 10      # reads up to this keep pages, larger ones their chunks


def spans(key: str, head: bytes, blen: int, chunk: int, lo: int, hi: int):
    """(LRU key, start, stop) of each piece a read of [lo, hi) (lo < hi) of a
    `blen`-byte block keeps: its pages if it is small, else its run of chunks."""
    if hi - lo <= PAGE_READ_MAX:
        return [((key, head, s, min(blen, s + PAGE)), s, min(blen, s + PAGE))
                for s in range(lo - lo % PAGE, hi, PAGE)]
    start, stop = lo - lo % chunk, min(blen, hi + -hi % chunk)
    return [((key, head, start, stop), start, stop)]


def lookup(peek, key: str, head: bytes, blen: int, chunk: int, lo: int, hi: int):
    """(the kept pieces that hold [lo, hi), the byte where the first starts),
    or None; `peek` is the LRU's lookup."""
    if hi - lo <= PAGE_READ_MAX:
        start = lo - lo % PAGE
        if hi - start <= PAGE:  # the usual small read: one page, no loop
            piece = peek((key, head, start, min(blen, start + PAGE)))
            if piece is not None:
                return [piece], start
        else:
            pages = []
            for s in range(start, hi, PAGE):
                piece = peek((key, head, s, min(blen, s + PAGE)))
                if piece is None:
                    break
                pages.append(piece)
            else:
                return pages, start
        start = lo - lo % chunk  # else the one chunk around it, if a larger read kept it
        if hi - start > chunk:
            return None
    else:
        start = lo - lo % chunk
    run = peek((key, head, start, min(blen, hi + -hi % chunk)))
    return None if run is None else ([run], start)


class ChunkCache:
    """Decrypted pages and chunks of one volume in one process, in the shared LRU `mem`."""

    def __init__(self, mem: BlockMemory, chunk_size: int, enabled: bool = True) -> None:
        self.mem = mem
        self.chunk_size = chunk_size
        # a budget that cannot hold a few chunks beside one block gains nothing
        self.enabled = bool(enabled) and mem.capacity > 0
        # block key -> (LRU key under UNSEALED, start, end) of pieces read before its seal
        self._pending: dict[str, set[tuple]] = {}
        # block key -> (where its last small read ended, whether that read
        # continued the one before it)
        self._ends: dict[str, tuple[int, bool]] = {}
        # block key -> the header this process sealed it with (its fill's file, once in place)
        self._sealed: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def wants(self, key: str, blen: int, lo: int, hi: int) -> bool:
        """Whether a read of [lo, hi) of `key`'s `blen`-byte block keeps its
        chunks. Racing threads can only make the guess worse, never a read wrong."""
        if not self.enabled or hi - lo >= blen or hi - lo > CHUNKED_READ_MAX:
            return False
        ends = self._ends
        last = ends.get(key)
        if last is not None and last[0] == lo:  # continues the last read
            ends[key] = (hi, True)
            if last[1]:  # and that one continued another: a stream
                self.mem.not_transient(key)
                return False
            return True  # random reads at aligned offsets meet by chance
        if len(ends) >= ENDS_LIMIT:
            ends.clear()
        ends[key] = (hi, False)
        return True

    def keep(self, key: str, head: bytes, blen: int, plain: bytes, start: int, lo: int,
             hi: int) -> None:
        """Keep what a read of [lo, hi) keeps (`spans`), cut from the plaintext
        `plain` it decrypted, which starts at byte `start` of the block."""
        for ck, s, e in spans(key, head, blen, self.chunk_size, lo, hi):
            if s == start and e - s == len(plain):  # the whole run: no copy
                self.mem.put(ck, plain)
            else:
                self.mem.put(ck, plain[s - start:e - start])

    def saw(self, key: str, data: bytes, head: bytes | None, lo: int, hi: int) -> None:
        """A read of [lo, hi) served from the block `data` in memory (sealed
        with `head`, None if not sealed yet): keep the pages or chunks it touched."""
        kept = spans(key, UNSEALED if head is None else head, len(data), self.chunk_size, lo, hi)
        if head is None:
            with self._lock:
                waiting = self._pending.get(key)
                if waiting is None:
                    if len(self._pending) >= PENDING_LIMIT:
                        self._pending.clear()
                    waiting = self._pending[key] = set()
                waiting.update(kept)
        mem = self.mem
        for ck, start, stop in kept:
            if mem.get(ck) is None:  # bytes: a view would hold a pooled block's buffer
                mem.put(ck, bytes(data[start:stop]))

    def sealed_head(self, key: str) -> bytes | None:
        """The header this process sealed `key`'s block with, if it did lately."""
        return self._sealed.get(key)

    def sealed(self, key: str, plaintext: bytes, head: bytes) -> None:
        """The block `plaintext` was sealed with `head` (the fill thread's
        `Sealer`): bind it if the LRU holds it, and keep the pages and chunks
        reads touched before under `head`, those that are exactly its bytes."""
        if not self.enabled:
            return
        self.mem.bind_head(key, plaintext, head)
        with self._lock:
            waiting = self._pending.pop(key, None)
            if len(self._sealed) >= PENDING_LIMIT:
                self._sealed.clear()
            self._sealed[key] = head
        for ck, start, stop in sorted(waiting or ()):
            piece = self.mem.pop(ck)
            # another fetch of this key may have left these (a file that
            # changed without a new version): only the same bytes are kept
            if piece is not None and piece == plaintext[start:stop]:
                self.mem.put((key, head) + ck[2:], piece)


def cut(piece: bytes, skip: int, n: int, out: memoryview | None):
    """piece[skip:skip + n] as bytes, or stored in `out` and its length returned."""
    if out is None:
        return piece[skip:skip + n]
    out[:n] = memoryview(piece)[skip:skip + n]
    return n


def assemble(pieces: list[bytes], start: int, lo: int, hi: int, out: memoryview | None):
    """Plaintext [lo, hi) of a block from consecutive pieces, the first
    starting at byte `start`: as bytes, or stored in `out` and its length returned."""
    skip = lo - start
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
