"""What a miss hands to the daemon: the block sealed under the volume key.

`DaemonLink.offer_fill` queues the plaintext (bounded in bytes: a full queue
drops and counts, never waits) and calls a `Sealer` on its fill thread (or
on the reader's thread for a small block with nothing queued ahead of it).
"""

from __future__ import annotations

from ...contract import blockfile
from ...contract.blockfile import HEADER_SIZE
from ..hits.chunks import ChunkCache
from ..hits.ciphers import Ciphers


class Sealer:
    """The fill thread's `blockfile.seal`. It seals into one buffer it reuses
    (the link's put has sent the previous block before it asks for the next:
    a fresh 4 MiB object per block would cost a page fault per 4 KiB), and
    keeps the new block's cipher, so this process reading the block back from
    the cache (the next epoch) skips its HKDF. Keyed by the exact header bytes
    it wrote: if the daemon keeps another writer's file instead, that header
    differs and this entry is simply never used. Holds no reference to the
    Volume (the link's threads would keep it alive)."""

    __slots__ = ("_volume_key", "_chunk_size", "_ciphers", "_buf", "_chunks")

    def __init__(self, volume_key: bytes, chunk_size: int, ciphers: Ciphers,
                 chunks: ChunkCache | None = None) -> None:
        self._volume_key = volume_key
        self._chunk_size = chunk_size
        self._ciphers = ciphers
        self._buf = bytearray()
        self._chunks = chunks  # told each block's header, to cache chunks under it

    def file_size(self, length: int) -> int:
        """Bytes of the block file of a `length`-byte block."""
        return blockfile.file_size(length, self._chunk_size)

    def __call__(self, key: str, plaintext: bytes, into: memoryview | None = None
                 ) -> memoryview:
        """The block file's bytes: in `into` (`file_size` bytes: a fill
        area's slot), else in the reused buffer, valid until the next call."""
        blob, cipher = blockfile.seal_into(key, plaintext, self._volume_key, self._chunk_size,
                                           self._buf if into is None else into)
        if into is None:
            self._buf = blob.obj  # the larger one, if it had to grow
        head = blob[:HEADER_SIZE].tobytes()
        self._ciphers.keep((key, head), cipher)
        if self._chunks is not None:
            self._chunks.sealed(key, plaintext, head)
        return blob
