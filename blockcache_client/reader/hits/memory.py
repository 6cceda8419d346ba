"""A bounded in-memory LRU of plaintext: whole blocks and decrypted chunks.

Why: a miss fetches a whole block (4 MiB by default) but the caller, e.g. FUSE
reading 128 KiB at a time, asks for a small piece; the next pieces must not
refetch the block while its fill is still on the way to the daemon. Small
random reads of cached blocks keep the chunks they decrypted (the reader's
`chunks`), in the same LRU: one budget covers both, so the memory a reader
holds is `capacity` whatever the mix. Bounded by bytes; an entry larger than
the whole budget is simply not kept.

Keys: a block key string for a block; a tuple (block key, header bytes,
start, stop) for a piece of its plaintext the chunk cache keeps (pages or
a run of chunks), valid only for the block file with that header (its
salt is random per fill, so a refill is a new name, never stale). A
block may be bound to the header it was sealed with (`bind_head`): only the
exact bytes object sealed is bound, and replacing or dropping the block
drops the binding. A piece is charged its bytes and `PIECE_OVERHEAD`.

A block fetched for one small random read is *transient*: worth keeping
only while its fill is on the way. It is kept only in free room or in the
place of older transient blocks, and when room is needed it goes before
anything else. Without this, each cold random read's 4 MiB block would push
out 64 chunks that the next epoch reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

ChunkKey = tuple[str, bytes, int, int]  # (block key, header, start, stop)
# what a piece costs beyond its bytes (its key tuple and ints, the LRU's
# node, the bytes object's header), charged to the budget: ~6% of a 4 KiB page
PIECE_OVERHEAD = 256


class BlockMemory:
    """Thread-safe LRU: block key or `ChunkKey` -> immutable bytes, capped at `capacity` bytes."""

    def __init__(self, capacity: int, piece_overhead: int = PIECE_OVERHEAD):
        self.capacity = max(0, int(capacity))
        self.piece_overhead = piece_overhead
        self._lock = threading.Lock()
        self._blocks: OrderedDict[str | ChunkKey, bytes] = OrderedDict()
        self._heads: dict[str, bytes] = {}  # block key -> header it was sealed with
        self._transient: OrderedDict[str, None] = OrderedDict()  # evicted first
        self._bytes = 0
        self.chunk_bytes = 0  # of `_bytes`, held by pieces (with their overhead)

    def get(self, key: str | ChunkKey) -> bytes | None:
        if not self._blocks:  # lock-free fast path for the common empty case
            return None
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
            return data

    def peek(self, key: str | ChunkKey) -> bytes | None:
        """`get` without the lock (the chunk cache's lookups, a handle's
        repeat hits): each dict step is atomic under the GIL, an entry
        dropped meanwhile still holds the right bytes, and a recency mark
        lost to a race only makes the LRU less exact."""
        blocks = self._blocks
        data = blocks.get(key)
        if data is not None:
            try:
                blocks.move_to_end(key)
            except KeyError:  # dropped since the get
                pass
        return data

    def get_bound(self, key: str) -> tuple[bytes | None, bytes | None]:
        """A block and the header it was sealed with (None if not bound yet),
        read together: the header is that of exactly these bytes."""
        if key not in self._blocks:  # lock-free: absent now is a miss either way
            return None, None
        with self._lock:
            data = self._blocks.get(key)
            if data is None:
                return None, None
            self._blocks.move_to_end(key)
            return data, self._heads.get(key)

    def put(self, key: str | ChunkKey, data: bytes, transient: bool = False) -> None:
        piece = type(key) is tuple
        cost = len(data) + self.piece_overhead if piece else len(data)
        if cost > self.capacity:
            return
        with self._lock:
            self._drop(key)
            if transient:
                while self._bytes + cost > self.capacity and self._transient:
                    self._drop(next(iter(self._transient)))
                if self._bytes + cost > self.capacity:
                    return  # it would push out chunks or a stream's blocks
                self._transient[key] = None
            self._blocks[key] = data
            self._bytes += cost
            if piece:
                self.chunk_bytes += cost
            while self._bytes > self.capacity:  # transient blocks first, then by recency
                self._drop(next(iter(self._transient), None) or next(iter(self._blocks)))

    def bind_head(self, key: str, data: bytes, head: bytes) -> bool:
        """Note that the block `data` (this very object) was sealed with
        `head`; False if the LRU no longer holds exactly it under `key`."""
        with self._lock:
            if self._blocks.get(key) is not data:
                return False
            self._heads[key] = head
            return True

    def pop(self, key: str | ChunkKey) -> bytes | None:
        """Remove an entry and return it (None if not held)."""
        with self._lock:
            data = self._blocks.get(key)
            self._drop(key)
            return data

    def not_transient(self, key: str) -> None:
        """The block is read on (a stream): keep it by recency like any other."""
        if key in self._transient:
            with self._lock:
                self._transient.pop(key, None)

    def _drop(self, key: str | ChunkKey) -> None:
        """Remove one entry (the caller holds the lock)."""
        old = self._blocks.pop(key, None)
        if old is None:
            return
        if type(key) is tuple:
            self._bytes -= len(old) + self.piece_overhead
            self.chunk_bytes -= len(old) + self.piece_overhead
        else:
            self._bytes -= len(old)
            self._heads.pop(key, None)
            self._transient.pop(key, None)

    def discard_prefix(self, prefix: str) -> int:
        """Drop every block and chunk whose block key starts with `prefix`;
        return how many entries."""
        with self._lock:
            # a copy first: a lock-free `peek` may reorder the dict meanwhile
            doomed = [k for k in list(self._blocks)
                      if (k[0] if type(k) is tuple else k).startswith(prefix)]
            for k in doomed:
                self._drop(k)
            return len(doomed)

    @property
    def used(self) -> int:
        return self._bytes
