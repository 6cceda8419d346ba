"""The per-block ciphers one volume derived in this process, shared by every
path that decrypts its blocks: cache hits (`hits`, `chunkhits`), the cluster
tier (`tier`), and the sealer (`fills`), which keeps the cipher of each block
it writes so reading it back skips the HKDF.

Keyed by (key, exact header bytes): a header seen before was validated then,
and its HKDF subkey is derived once. The oldest goes first past
CIPHER_LIMIT. Only writers lock; readers `get` (a dict get is atomic: no
lock on the hit path).
"""

from __future__ import annotations

import threading

from ...contract.blockfile import BlockCipher, key_id
from ...contract.errors import FormatError

CIPHER_LIMIT = 4096       # derived per-block ciphers kept (saves an HKDF per hit)


class Ciphers:
    """One volume's derived ciphers (see the module doc)."""

    __slots__ = ("by_head", "_lock", "_volume_key", "_key_id", "_chunk_size")

    def __init__(self, volume_key: bytes, chunk_size: int) -> None:
        self.by_head: dict[tuple[str, bytes], BlockCipher] = {}
        self._lock = threading.Lock()
        self._volume_key = volume_key
        self._key_id = key_id(volume_key)
        self._chunk_size = chunk_size

    def get(self, ck: tuple[str, bytes]) -> BlockCipher | None:
        return self.by_head.get(ck)

    def keep(self, ck: tuple[str, bytes], cipher: BlockCipher) -> None:
        with self._lock:
            self.by_head[ck] = cipher
            if len(self.by_head) > CIPHER_LIMIT:
                del self.by_head[next(iter(self.by_head))]

    def cipher(self, key: str, head: bytes, blen: int) -> BlockCipher:
        """The cipher of `key`'s block file with header `head`, which must hold
        `blen` bytes in this volume's chunks: FormatError for a bad header or
        another length, IntegrityError for a foreign key."""
        ck = (key, head)
        cipher = self.by_head.get(ck)
        if cipher is None:
            cipher = BlockCipher.from_head(head, key, self._volume_key, self._key_id)
            self.keep(ck, cipher)
        if cipher.plaintext_len != blen or cipher.chunk_size != self._chunk_size:
            raise FormatError(f"block holds {cipher.plaintext_len} bytes in chunks of "
                              f"{cipher.chunk_size}; this file version needs {blen} in "
                              f"chunks of {self._chunk_size}")
        return cipher
