"""Block file format: a fixed header, then chunked AES-256-GCM ciphertext.

Byte layout (all integers big-endian), format version 1:

    offset size  field
    0      4     magic            b"BCBK"
    4      1     format version   1
    5      1     cipher id        1 = AES-256-GCM, per-block subkey by HKDF-SHA256
    6      2     flags            0 (reserved; non-zero is rejected)
    8      8     key id           SHA-256("blockcache key-id v1" || volume key)[:8]
    16     16    salt             random per block; HKDF salt for the subkey
    32     8     plaintext length 0 .. MAX_PLAINTEXT
    40     4     chunk size       power of two, MIN_CHUNK .. MAX_CHUNK
    44     4     reserved         0
    48     ...   chunks           ceil(len / chunk) chunks (at least one), each
                                  the chunk's ciphertext followed by a 16-byte tag

Per block:  subkey = HKDF-SHA256(ikm=volume key, salt=salt, info="blockcache block v1")
Per chunk:  nonce  = u64 chunk index || u8 last-chunk flag || 3 zero bytes
            aad    = the 48 header bytes || the block key string (UTF-8)

Why this holds:
- Nonces never repeat: the subkey is fresh per block (random 128-bit salt), and
  within a block each chunk index is used once. So any number of writers may
  share a volume key.
- A random read decrypts only the chunks it touches (64 KiB by default).
- The header is authenticated by every chunk (aad), the key string binds the
  file to its name (a renamed or swapped file fails), the index in the nonce
  fixes chunk order, and the last-chunk flag plus the length in the header
  catch truncation and extension.
- The daemon never holds a volume key: `BlockHeader.parse` plus
  `check_file_size` is all it can (and needs to) check.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import FormatError, IntegrityError

MAGIC = b"BCBK"
FORMAT_VERSION = 1
CIPHER_AES256GCM_HKDF = 1
HEADER = struct.Struct(">4sBBH8s16sQI4x")
HEADER_SIZE = HEADER.size  # 48
TAG_SIZE = 16
KEY_SIZE = 32
SALT_SIZE = 16
MIN_CHUNK = 4 << 10
MAX_CHUNK = 1 << 20
DEFAULT_CHUNK = 64 << 10
MAX_PLAINTEXT = 16 << 20  # the largest block size a volume may use
_NONCE = struct.Struct(">QB3x")
# what every valid header holds at 0..8 (magic, version, cipher id, no flags)
# and at 44..48 (reserved): checked at once on the read path
_FIXED_HEAD = MAGIC + bytes((FORMAT_VERSION, CIPHER_AES256GCM_HKDF, 0, 0))
_RESERVED = bytes(4)
_VARYING = struct.Struct(">8s16sQI")  # key id, salt, length, chunk size at offset 8
_HKDF_INFO = b"blockcache block v1"


def key_id(volume_key: bytes) -> bytes:
    """8 bytes naming a volume key without revealing it (lets a reader tell
    "wrong key" apart from "tampered" before trying to decrypt)."""
    _check_volume_key(volume_key)
    return hashlib.sha256(b"blockcache key-id v1" + volume_key).digest()[:8]


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    """32 bytes of HKDF-SHA256 (RFC 5869), as `cryptography` computes it."""
    return HKDF(algorithm=_SHA256, length=32, salt=salt, info=info).derive(ikm)


_SHA256 = hashes.SHA256()


def _check_volume_key(volume_key: bytes) -> None:
    if not isinstance(volume_key, (bytes, bytearray)) or len(volume_key) != KEY_SIZE:
        raise ValueError(f"volume key must be {KEY_SIZE} bytes")


def _header_fields(data: bytes | memoryview) -> tuple[bytes, bytes, int, int]:
    """(key id, salt, plaintext length, chunk size) of a valid header (format
    version and cipher id are the only ones there are); FormatError otherwise."""
    if len(data) < HEADER_SIZE:
        raise FormatError(f"block file is {len(data)} bytes, shorter than its "
                          f"{HEADER_SIZE}-byte header")
    magic, version, cipher, flags, kid, salt, length, chunk = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError(f"not a block file: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise FormatError(f"block file format version {version} is not supported "
                          f"(this build reads version {FORMAT_VERSION})")
    if cipher != CIPHER_AES256GCM_HKDF:
        raise FormatError(f"block file cipher id {cipher} is not supported")
    if flags != 0 or data[44:48] != b"\0\0\0\0":
        raise FormatError("block file header has reserved bits set")
    if length > MAX_PLAINTEXT:
        raise FormatError(f"block length {length} exceeds the maximum {MAX_PLAINTEXT}")
    if not MIN_CHUNK <= chunk <= MAX_CHUNK or chunk & (chunk - 1):
        raise FormatError(f"chunk size {chunk} is not a power of two in "
                          f"{MIN_CHUNK}..{MAX_CHUNK}")
    return kid, salt, length, chunk


def file_size(plaintext_len: int, chunk_size: int) -> int:
    """Bytes of the block file sealing `plaintext_len` bytes in `chunk_size` chunks."""
    return HEADER_SIZE + plaintext_len + max(1, -(-plaintext_len // chunk_size)) * TAG_SIZE


def chunk_span(plaintext_len: int, chunk_size: int, offset: int, length: int
               ) -> tuple[int, int]:
    """Chunks [first, end) of a block of `plaintext_len` bytes that plaintext
    bytes [offset, offset+length) touch: at least one chunk (an empty range,
    or one at or past the end, names the chunk it is in or the last one, so
    even a read of nothing authenticates something)."""
    if offset < 0 or length < 0:
        raise ValueError("offset and length must not be negative")
    if offset > plaintext_len:
        offset = plaintext_len
    stop = offset + length
    if stop > plaintext_len:
        stop = plaintext_len
    first = offset // chunk_size
    end = -(-stop // chunk_size)
    if end <= first:
        end = first + 1
    last = (plaintext_len - 1) // chunk_size if plaintext_len > chunk_size else 0
    return (first if first <= last else last), (end if end <= last else last + 1)


@dataclass(frozen=True, slots=True)
class BlockHeader:
    key_id: bytes
    salt: bytes
    plaintext_len: int
    chunk_size: int
    version: int = FORMAT_VERSION
    cipher: int = CIPHER_AES256GCM_HKDF

    @property
    def nchunks(self) -> int:
        return max(1, -(-self.plaintext_len // self.chunk_size))

    @property
    def file_size(self) -> int:
        return file_size(self.plaintext_len, self.chunk_size)

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, self.version, self.cipher, 0, self.key_id, self.salt,
                           self.plaintext_len, self.chunk_size)

    @classmethod
    def parse(cls, data: bytes | memoryview) -> BlockHeader:
        """Validate and parse a header without any key. Raises FormatError."""
        return cls(*_header_fields(data))

    def check_file_size(self, size: int) -> None:
        """FormatError unless a file of `size` bytes is exactly this block's length."""
        if size != self.file_size:
            raise FormatError(f"block file is {size} bytes; its header says {self.file_size}")

    def chunk_span(self, offset: int, length: int) -> tuple[int, int]:
        """Chunks [first, end) that plaintext bytes [offset, offset+length) touch."""
        return chunk_span(self.plaintext_len, self.chunk_size, offset, length)

    def ciphertext_range(self, first: int, end: int) -> tuple[int, int]:
        """File byte range [start, stop) holding chunks [first, end)."""
        step = self.chunk_size + TAG_SIZE
        start = HEADER_SIZE + first * step
        stop = min(HEADER_SIZE + end * step, self.file_size)
        return start, stop


class BlockCipher:
    """The per-block AEAD state: derived once, used for each chunk touched.
    Read-only after construction (threads share one)."""

    __slots__ = ("plaintext_len", "chunk_size", "_aead", "_aad", "_last", "_header")

    def __init__(self, header: BlockHeader, key: str, volume_key: bytes):
        _check_volume_key(volume_key)
        made = BlockCipher.from_head(header.pack(), key, volume_key, key_id(volume_key))
        self.plaintext_len, self.chunk_size = made.plaintext_len, made.chunk_size
        self._aead, self._aad, self._last = made._aead, made._aad, made._last
        self._header = header

    @classmethod
    def from_head(cls, head: bytes | memoryview, key: str, volume_key: bytes,
                  kid: bytes) -> BlockCipher:
        """The cipher of a block file whose first HEADER_SIZE bytes are `head`,
        for a volume key whose `key_id` the caller computed once (a new reader
        derives one cipher per block it reads, so this skips what it can: no
        BlockHeader object, no key id, no re-packed header). FormatError for
        a bad header, IntegrityError for another key's block."""
        head = bytes(head[:HEADER_SIZE])
        if head[:8] == _FIXED_HEAD and head[44:] == _RESERVED:
            block_kid, salt, length, chunk = _VARYING.unpack_from(head, 8)
            if length > MAX_PLAINTEXT or not MIN_CHUNK <= chunk <= MAX_CHUNK or chunk & (chunk - 1):
                _header_fields(head)  # raises, naming the field
        else:
            block_kid, salt, length, chunk = _header_fields(head)  # raises (or: short)
        if block_kid != kid:
            raise IntegrityError(f"block {key} was sealed with key id {block_kid.hex()}, "
                                 f"not this volume's key ({kid.hex()})")
        cipher = cls.__new__(cls)
        cipher._header = None
        cipher.plaintext_len = length
        cipher.chunk_size = chunk
        cipher._aead = AESGCM(hkdf_sha256(volume_key, salt, _HKDF_INFO))
        # a valid header packs back to exactly these bytes (the reserved
        # fields are zero), so they are the aad's header part as they are
        cipher._aad = head + key.encode()
        cipher._last = (length - 1) // chunk if length > chunk else 0
        return cipher

    @property
    def header(self) -> BlockHeader:
        """The block's parsed header."""
        h = self._header
        if h is None:
            h = self._header = BlockHeader.parse(self._aad)
        return h

    def seal_chunk_into(self, index: int, plaintext: bytes | memoryview,
                        out: memoryview) -> None:
        """Encrypt chunk `index` into `out`: its ciphertext, then its tag
        (exactly len(plaintext) + TAG_SIZE bytes)."""
        self._aead.encrypt_into(_NONCE.pack(index, index == self._last), plaintext, self._aad,
                                out)

    def _check_span(self, first: int, end: int, got: int) -> None:
        """IntegrityError unless `got` bytes are exactly chunks [first, end)'s ciphertext."""
        step = self.chunk_size + TAG_SIZE
        stop = (min(end * step, self.plaintext_len + (self._last + 1) * TAG_SIZE)
                - first * step)
        if got != stop:
            raise IntegrityError(f"block ciphertext for chunks {first}..{end} is "
                                 f"{got} bytes, expected {stop} (truncated?)")

    def open_chunks(self, first: int, end: int, data: bytes | memoryview) -> bytes:
        """Decrypt chunks [first, end) from exactly their ciphertext; IntegrityError
        if the data is short (a truncated file) or any chunk fails."""
        view = memoryview(data)
        self._check_span(first, end, len(view))
        decrypt, aad, last, nonce = self._aead.decrypt, self._aad, self._last, _NONCE.pack
        index = first
        try:
            if end - first == 1:
                return decrypt(nonce(index, index == last), view, aad)
            step = self.chunk_size + TAG_SIZE
            out = []
            for pos in range(0, len(view), step):
                out.append(decrypt(nonce(index, index == last), view[pos:pos + step], aad))
                index += 1
        except (InvalidTag, ValueError):  # ValueError: shorter than a tag
            raise IntegrityError(f"block chunk {index} failed authentication") from None
        return b"".join(out)

    def open_into(self, first: int, end: int, chunks: memoryview, out: memoryview) -> None:
        """Decrypt whole chunks [first, end) from exactly their ciphertext
        `chunks` into `out`, exactly their plaintext (a large read's unit: the
        caller sized both). IntegrityError if a chunk fails; `out` then holds
        unauthenticated bytes, which the caller must zero."""
        decrypt_into, aad, last, nonce = self._aead.decrypt_into, self._aad, self._last, _NONCE.pack
        csize = self.chunk_size
        step = csize + TAG_SIZE
        cpos = pos = 0
        index = first
        try:
            for index in range(first, end):  # the last chunk may be shorter: to the ends
                decrypt_into(nonce(index, index == last), chunks[cpos:cpos + step], aad,
                             out[pos:pos + csize])
                cpos += step
                pos += csize
        except (InvalidTag, ValueError):  # ValueError: shorter than a tag, or sizes disagree
            raise IntegrityError(f"block chunk {index} failed authentication") from None

    def read_range_into(self, offset: int, chunks: bytes | memoryview, out: memoryview) -> None:
        """`read_range(offset, len(out), chunks)` stored in `out` (a writable
        byte view): whole chunks decrypt straight into it, no intermediate
        copies. IntegrityError as `open_chunks`; `out` is then zeroed (AES-GCM
        writes plaintext before it checks the tag: none may stay there)."""
        length = len(out)
        view = memoryview(chunks)
        csize = self.chunk_size
        step = csize + TAG_SIZE
        last = self._last
        whole = offset == 0 and length == self.plaintext_len  # a small file's every read
        if whole:
            first = 0
            if len(view) != length + (last + 1) * TAG_SIZE:
                self._check_span(0, last + 1, len(view))  # raises
        else:
            first, end = chunk_span(self.plaintext_len, csize, offset, length)
            self._check_span(first, end, len(view))
        decrypt_into, aad, nonce = self._aead.decrypt_into, self._aad, _NONCE.pack
        index = first
        try:
            if whole:  # each chunk decrypts whole into its place, the last one shorter
                cpos = pos = 0
                for index in range(last + 1):
                    decrypt_into(nonce(index, index == last), view[cpos:cpos + step], aad,
                                 out[pos:pos + csize])
                    cpos += step
                    pos += csize
                return
            decrypt = self._aead.decrypt
            pos = first * csize - offset  # where chunk `index` starts in `out` (may be < 0)
            for cpos in range(0, len(view), step):
                piece = view[cpos:cpos + step]
                plain_len = len(piece) - TAG_SIZE
                if 0 <= pos and pos + plain_len <= length:
                    decrypt_into(nonce(index, index == last), piece, aad,
                                 out[pos:pos + plain_len])
                else:  # a chunk cut by the range's ends: decrypt whole, keep the part
                    plain = decrypt(nonce(index, index == last), piece, aad)
                    lo, hi = max(0, -pos), min(plain_len, length - pos)
                    if lo < hi:
                        out[pos + lo:pos + hi] = memoryview(plain)[lo:hi]
                pos += csize
                index += 1
        except (InvalidTag, ValueError):  # ValueError: shorter than a tag
            out[:] = bytes(length)
            raise IntegrityError(f"block chunk {index} failed authentication") from None

    def read_range(self, offset: int, length: int, chunks: bytes | memoryview) -> bytes:
        """Plaintext [offset, offset+length) given the ciphertext of exactly the
        chunks `chunk_span(plaintext_len, chunk_size, offset, length)` names."""
        if offset == 0 and length >= self.plaintext_len:  # the whole block (a small file)
            return self.open_chunks(0, self._last + 1, chunks)
        first, end = chunk_span(self.plaintext_len, self.chunk_size, offset, length)
        plain = self.open_chunks(first, end, chunks)
        skip = offset - first * self.chunk_size
        return plain[skip:skip + length] if (skip or len(plain) > length) else plain


def seal(key: str, plaintext: bytes | memoryview, volume_key: bytes,
         chunk_size: int = DEFAULT_CHUNK) -> bytes:
    """Encrypt one block into the bytes of its block file."""
    view, _ = seal_into(key, plaintext, volume_key, chunk_size)
    return view.tobytes()


def seal_into(key: str, plaintext: bytes | memoryview, volume_key: bytes,
              chunk_size: int = DEFAULT_CHUNK, buf: bytearray | None = None
              ) -> tuple[memoryview, BlockCipher]:
    """`seal`, written into `buf` (or into a new buffer when it is None or
    too short: the view's `.obj` is the buffer used, to keep for next time):
    returns a view of the block file's bytes, and the block's cipher (which
    reads the block back without another HKDF). Each chunk is encrypted in
    place: no per-chunk objects, no join, and a reused buffer costs no page
    faults (a fill thread seals every block it caches)."""
    length = len(plaintext)
    if length > MAX_PLAINTEXT:
        raise ValueError(f"block of {length} bytes exceeds the maximum {MAX_PLAINTEXT}")
    _check_volume_key(volume_key)
    header = BlockHeader(key_id(volume_key), os.urandom(SALT_SIZE), length, chunk_size)
    packed = header.pack()
    # validates the header (chunk size) and derives the cipher, hashing the
    # volume key and packing the header once
    cipher = BlockCipher.from_head(packed, str(key), volume_key, header.key_id)
    size = header.file_size
    if buf is None or len(buf) < size:
        buf = bytearray(size)
    out = memoryview(buf)[:size]
    out[:HEADER_SIZE] = packed
    src = memoryview(plaintext)
    pos = HEADER_SIZE
    for i in range(header.nchunks):
        piece = src[i * chunk_size:(i + 1) * chunk_size]
        end = pos + len(piece) + TAG_SIZE
        cipher.seal_chunk_into(i, piece, out[pos:end])
        pos = end
    return out, cipher


def unseal(key: str, blob: bytes | memoryview, volume_key: bytes,
           offset: int = 0, length: int | None = None) -> bytes:
    """Decrypt plaintext [offset, offset+length) of a whole block file.

    Only the chunks the range touches are decrypted. Raises IntegrityError for
    anything that is not exactly the block `key` sealed under `volume_key`.
    """
    try:
        header = BlockHeader.parse(blob)
        header.check_file_size(len(blob))
    except FormatError as exc:
        raise IntegrityError(f"block {key}: {exc}") from None
    if length is None:
        length = max(0, header.plaintext_len - offset)
    if offset < 0 or length < 0:
        raise ValueError("offset and length must not be negative")
    cipher = BlockCipher(header, str(key), volume_key)
    first, end = header.chunk_span(offset, length)
    start, stop = header.ciphertext_range(first, end)
    if offset >= header.plaintext_len:
        cipher.open_chunks(first, end, memoryview(blob)[start:stop])  # still authenticate
        return b""
    length = min(length, header.plaintext_len - offset)
    return cipher.read_range(offset, length, memoryview(blob)[start:stop])
