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
truncated or extended slice is refused from its declared size, before any of
it is read (`Landing.sizes`, checked by `Memcache.get_into`), and a
misplaced one from its head, before any decryption.
Only ciphertext is stored: a host without the volume key learns nothing.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

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


class Landing:
    """Where the slices `wanted` of one block shaped `geo` land as they
    arrive (`place`, for `Memcache.get_into`): each slice's 56-byte head in a
    row of heads, its chunks straight after the previous slice's in `buf`,
    behind room for the block header. So the ciphertext of consecutive
    slices is contiguous (a range decrypts from it as it is), and once every
    slice of a block is in and `open`ed, `buf` is the block file's bytes: no
    per-slice buffers, no join. `buf` is the start of `room(size)`, kept as
    `room` (the caller may reuse buffers: that costs no zeroing, no page faults)."""

    __slots__ = ("geo", "wanted", "names", "sizes", "room", "buf", "received", "header",
                 "_heads", "_where")

    def __init__(self, key: str, geo: Geometry, wanted: range,
                 room: Callable[[int], memoryview] = lambda n: memoryview(bytearray(n))):
        self.geo = geo
        self.wanted = wanted
        self.names = [item_key(key, i) for i in wanted]
        # the size each item must have: the only one `place` is ever asked for
        self.sizes = {name: SLICE_HEAD_SIZE + geo.body_len(i)
                      for name, i in zip(self.names, wanted)}
        # item name -> (slice index, its head's offset in _heads, its body's in buf)
        self._where: dict[str, tuple[int, int, int]] = {}
        pos = HEADER_SIZE
        for n, (name, i) in enumerate(zip(self.names, wanted)):
            self._where[name] = (i, n * SLICE_HEAD_SIZE, pos)
            pos += geo.body_len(i)
        self.room = room(pos)
        self.buf = self.room[:pos]
        self._heads = bytearray(len(wanted) * SLICE_HEAD_SIZE)
        self.received = 0  # value bytes placed
        self.header: bytes | None = None  # the block header, once a slice is checked

    def place(self, name: str, size: int) -> list[memoryview]:
        """Where item `name`'s `size` bytes go (its size in `sizes`: the
        client refuses any other before asking)."""
        i, head, body = self._where[name]
        if size != self.sizes[name]:  # our caller's bug: never a server's doing
            raise ValueError(f"item {name} is {self.sizes[name]} bytes, not {size}")
        self.received += size
        return [memoryview(self._heads)[head:head + SLICE_HEAD_SIZE],
                self.buf[body:body + size - SLICE_HEAD_SIZE]]

    def open(self) -> tuple[bytes, memoryview]:
        """(block header bytes, the wanted slices' ciphertext) once each was
        placed whole; FormatError as `check`. Authentication is the
        caller's: it decrypts with the header."""
        for name in self.names:
            self.check(name)
        assert self.header is not None
        return self.header, self.buf[HEADER_SIZE:]

    def check(self, name: str) -> tuple[int, memoryview]:
        """(slice index, its chunks' ciphertext) of item `name` once it was
        placed whole, so it can be decrypted while later items arrive;
        FormatError for a foreign or misplaced slice, or one of another copy
        than the slices checked before (an eviction raced a fill). The first
        slice checked sets `header`."""
        i, head_at, body = self._where[name]
        geo = self.geo
        magic, got_index, count = _SLICE_HEAD.unpack_from(self._heads, head_at)
        if magic != MAGIC:
            raise FormatError(f"slice {i} is not a blockcache tier item (magic {magic!r})")
        if got_index != i or count != geo.count:
            raise FormatError(f"slice {i} of {geo.count} says it is slice {got_index} "
                              f"of {count}")
        head = self._heads[head_at + _SLICE_HEAD.size:head_at + SLICE_HEAD_SIZE]
        if self.header is None:
            self.header = bytes(head)
            self.buf[:HEADER_SIZE] = self.header
        elif head != self.header:
            raise FormatError(f"slice {i} belongs to another copy of the block")
        return i, self.buf[body:body + geo.body_len(i)]
