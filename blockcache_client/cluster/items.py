"""How a sealed block is stored in memcached: slices of under 512 KiB each.

Item `bc1:<block key>:<i>` (i = 0 .. count-1) holds, big-endian:

    offset size  field
    0      4     magic          b"BCT1"
    4      2     slice index    i
    6      2     slice count    count
    8      48    the block file's header (contract/blockfile.py)
    56     ...   the block file's chunks [i*k, (i+1)*k): ciphertext + tag each

k (chunks per slice) is as many as fit in `SLICE_LIMIT`: 7 chunks of 64 KiB,
so a 4 MiB block is 10 items, and a 4 KiB read moves one item, or two where
it straddles a slice boundary: under 1 MiB either way. (Slices of ~1 MiB
would cost a straddling read 2 MiB.) Items under 512 KiB also fit one of
memcached's slab chunks (`slab_chunk_max`) instead of being chained.
Every slice repeats the block header, so a range read needs only its own
slices and authenticates them on their own: the chunks' AEAD binds the
header, the key string and each chunk's index. The size every slice must have
follows from the block length and chunk size the reader expects, so a
truncated, extended or misplaced slice is refused before any decryption.
Only ciphertext is stored: a host without the volume key learns nothing.
"""

from __future__ import annotations

import struct

from ..contract.blockfile import HEADER_SIZE, TAG_SIZE, BlockHeader
from ..contract.errors import FormatError

MAGIC = b"BCT1"
PREFIX = "bc1:"
_SLICE_HEAD = struct.Struct(">4sHH")
SLICE_HEAD_SIZE = _SLICE_HEAD.size + HEADER_SIZE  # 56
# half memcached's default 1 MiB item limit (see above), less 4 KiB for its
# item header and the key
SLICE_LIMIT = (512 << 10) - (4 << 10)
MAX_KEY_LEN = 250  # memcached's limit


def item_key(key: str, index: int) -> str:
    return f"{PREFIX}{key}:{index}"


def fits(key: str) -> bool:
    """Whether `key`'s items have names memcached accepts."""
    return len(item_key(key, 0xFFFF)) <= MAX_KEY_LEN


class Geometry:
    """Where the chunks of a block of `blen` bytes in `chunk`-byte chunks go."""

    __slots__ = ("blen", "chunk", "nchunks", "per", "count")

    def __init__(self, blen: int, chunk: int):
        self.blen = blen
        self.chunk = chunk
        self.nchunks = max(1, -(-blen // chunk))
        self.per = max(1, (SLICE_LIMIT - SLICE_HEAD_SIZE) // (chunk + TAG_SIZE))
        self.count = -(-self.nchunks // self.per)

    def chunks(self, index: int) -> tuple[int, int]:
        """Chunks [first, end) slice `index` holds."""
        first = index * self.per
        return first, min(first + self.per, self.nchunks)

    def body_len(self, index: int) -> int:
        """Ciphertext bytes of slice `index` (its chunks and their tags)."""
        first, end = self.chunks(index)
        plain = min(end * self.chunk, self.blen) - first * self.chunk
        return plain + (end - first) * TAG_SIZE

    def slices(self, first_chunk: int, end_chunk: int) -> range:
        """The slices holding chunks [first_chunk, end_chunk)."""
        return range(first_chunk // self.per, (end_chunk - 1) // self.per + 1)


def split(key: str, blob: bytes | memoryview) -> list[tuple[str, bytes]]:
    """A block file's bytes as (item key, value) pairs; FormatError if the
    blob is not a well-formed block file."""
    view = memoryview(blob)
    header = BlockHeader.parse(view)
    header.check_file_size(len(view))
    geo = Geometry(header.plaintext_len, header.chunk_size)
    if geo.count > 0xFFFF:
        raise FormatError(f"block {key} would need {geo.count} slices")
    head = view[:HEADER_SIZE]
    out = []
    pos = HEADER_SIZE
    for i in range(geo.count):
        n = geo.body_len(i)
        value = b"".join((_SLICE_HEAD.pack(MAGIC, i, geo.count), head, view[pos:pos + n]))
        out.append((item_key(key, i), value))
        pos += n
    return out


def check(geo: Geometry, index: int, value: bytes) -> tuple[bytes, memoryview]:
    """(block header bytes, ciphertext) of slice `index` of a block shaped
    `geo`; FormatError for anything else (foreign, truncated, misplaced).
    Authentication is the caller's: it decrypts with the header."""
    if len(value) < SLICE_HEAD_SIZE:
        raise FormatError(f"slice {index} is {len(value)} bytes, shorter than its header")
    magic, got_index, count = _SLICE_HEAD.unpack_from(value)
    if magic != MAGIC:
        raise FormatError(f"slice {index} is not a blockcache tier item (magic {magic!r})")
    if got_index != index or count != geo.count:
        raise FormatError(f"slice {index} of {geo.count} says it is slice {got_index} "
                          f"of {count}")
    want = SLICE_HEAD_SIZE + geo.body_len(index)
    if len(value) != want:
        raise FormatError(f"slice {index} is {len(value)} bytes where {want} belong "
                          f"(truncated or extended)")
    view = memoryview(value)
    return bytes(view[_SLICE_HEAD.size:SLICE_HEAD_SIZE]), view[SLICE_HEAD_SIZE:]


def assemble(geo: Geometry, values: list[bytes]) -> tuple[bytes, bytes]:
    """(header, the whole block file's bytes) from all its slices in order;
    FormatError if a slice is malformed or they carry different headers
    (slices of two writers' copies, after an eviction raced a fill)."""
    head = None
    parts: list[bytes | memoryview] = []
    for i, value in enumerate(values):
        h, body = check(geo, i, value)
        if head is None:
            head = h
            parts.append(h)
        elif h != head:
            raise FormatError(f"slice {i} belongs to another copy of the block")
        parts.append(body)
    assert head is not None
    return head, b"".join(parts)
