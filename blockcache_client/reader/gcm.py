"""Block chunks opened with OpenSSL's libcrypto through ctypes, without the GIL.

Why: `cryptography`'s AESGCM runs only partly in parallel on several
threads (64 KiB chunks on an idle 2-vCPU host: 3.55 GB/s on one, 4.7-5.1
on two). ctypes lets go of the GIL around each foreign call, so the long
one here (EVP_DecryptUpdate over a chunk) runs on every core at once
(`decrypt.ParallelDecrypt`). The algorithm and layout are
`contract.blockfile`'s: each chunk is its ciphertext then a 16-byte tag,
opened with the block's subkey, the chunk's nonce and the block's aad
(`BlockCipher.subkey`, `.nonce`, `.aad`).

A tag that does not match is IntegrityError, and the chunk's plaintext,
written before the tag is checked, is zeroed. Where libcrypto cannot be
loaded (`available()` False), readers decrypt with `cryptography` alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

from ..contract.blockfile import TAG_SIZE, BlockCipher
from ..contract.errors import IntegrityError

log = logging.getLogger(__name__)

_SET_TAG = 0x11            # EVP_CTRL_GCM_SET_TAG (= EVP_CTRL_AEAD_SET_TAG)


def _load():
    """libcrypto with the signatures used here, or None."""
    name = ctypes.util.find_library("crypto")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)  # CDLL: the GIL is released around each call
        ptr, cint = ctypes.c_void_p, ctypes.c_int
        lib.EVP_CIPHER_CTX_new.restype = ptr
        lib.EVP_CIPHER_CTX_new.argtypes = []
        lib.EVP_CIPHER_CTX_free.argtypes = [ptr]
        lib.EVP_aes_256_gcm.restype = ptr
        lib.EVP_DecryptInit_ex.argtypes = [ptr, ptr, ptr, ctypes.c_char_p, ctypes.c_char_p]
        lib.EVP_DecryptUpdate.argtypes = [ptr, ptr, ctypes.POINTER(cint), ptr, cint]
        lib.EVP_DecryptFinal_ex.argtypes = [ptr, ptr, ctypes.POINTER(cint)]
        lib.EVP_CIPHER_CTX_ctrl.argtypes = [ptr, cint, cint, ptr]
        return lib
    except (OSError, AttributeError) as exc:
        log.info("libcrypto %s cannot be used (%s): chunks decrypt with cryptography", name, exc)
        return None


_lib = _load()
_local = threading.local()


def available() -> bool:
    return _lib is not None


class _Context:
    """One thread's EVP cipher context (a context is not thread-safe)."""

    __slots__ = ("ctx", "outl", "_free")

    def __init__(self) -> None:
        self.ctx = _lib.EVP_CIPHER_CTX_new()
        if not self.ctx or _lib.EVP_DecryptInit_ex(self.ctx, _lib.EVP_aes_256_gcm(), None,
                                                   None, None) != 1:
            raise MemoryError("libcrypto: cannot make an AES-256-GCM context")
        self.outl = ctypes.c_int()
        self._free = _lib.EVP_CIPHER_CTX_free  # still there while the interpreter exits

    def __del__(self) -> None:
        if self.ctx:
            self._free(self.ctx)
            self.ctx = None


def _context() -> _Context:
    c = getattr(_local, "context", None)
    if c is None:
        c = _local.context = _Context()
    return c


def open_into(cipher: BlockCipher, first: int, body: memoryview, out: memoryview) -> None:
    """Decrypt whole chunks from chunk `first` on: `body` holds exactly their
    ciphertext and tags, `out` (writable) gets exactly their plaintext.
    IntegrityError if a tag does not match (that chunk is zeroed; the
    caller zeroes the rest of what it asked for)."""
    c = _context()
    ctx, outl, lib = c.ctx, c.outl, _lib
    size = cipher.chunk_size
    step = size + TAG_SIZE
    aad = cipher.aad
    src = ctypes.addressof((ctypes.c_char * len(body)).from_buffer(body))
    dst = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out))
    if lib.EVP_DecryptInit_ex(ctx, None, None, cipher.subkey, None) != 1:
        raise IntegrityError("libcrypto refused the block's subkey")
    pos = cpos = 0
    index = first
    total = len(out)
    while pos < total:
        n = min(size, total - pos)
        ok = (lib.EVP_DecryptInit_ex(ctx, None, None, None, cipher.nonce(index)) == 1
              and lib.EVP_DecryptUpdate(ctx, None, outl, aad, len(aad)) == 1
              and lib.EVP_DecryptUpdate(ctx, dst + pos, outl, src + cpos, n) == 1
              and lib.EVP_CIPHER_CTX_ctrl(ctx, _SET_TAG, TAG_SIZE, src + cpos + n) == 1
              and lib.EVP_DecryptFinal_ex(ctx, dst + pos + n, outl) == 1)
        if not ok:
            ctypes.memset(dst + pos, 0, n)
            raise IntegrityError(f"block chunk {index} failed authentication")
        pos += n
        cpos += step
        index += 1
