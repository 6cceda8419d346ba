"""Block keys: `{vol}_{inode}_{extent}_{offset}`, one canonical string form
(key format 2, `KEY_FORMAT`).

    vol     1-63 chars of [a-z0-9.-], starting with a letter or digit
    inode   decimal, 0 < inode < 2**63, no leading zeros
    extent  32 lowercase hex digits: one immutable version of the file's data
    offset  16 lowercase hex digits: the block's start offset in the file

Invariant: one key names exactly one byte string, forever. Parsing is strict:
anything that is not the canonical form is rejected, never "fixed", so a key
can never name a path outside the cache directory (no '/', '..', NUL, spaces).

`KeyNamer` at the bottom derives `inode` and `extent` with a key from the
volume key, so that every host and every restart holding that key computes
the same keys for the same bytes, a changed remote file gets new keys (its
old blocks are never read again and age out), and nobody without the key
can tell which path a key names.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from .errors import InvalidKey

KEY_FORMAT = 2     # 1: unkeyed ids, 16-digit extents (refused, removed by the scan)
MAX_INODE = 2**63 - 1
EXTENT_BYTES = 16  # 128-bit extents: 32 hex digits
ROOT_INODE = 1  # FUSE's root; no file path hashes to it

EXAMPLE_EXTENT = "0123456789abcdef00000000deadbeef"
_VOL = r"[a-z0-9][a-z0-9.-]{0,62}"
_VOL_RE = re.compile(rf"^{_VOL}$")
_KEY_RE = re.compile(rf"^({_VOL})_([1-9][0-9]{{0,18}})_([0-9a-f]{{32}})_([0-9a-f]{{16}})$")


def check_volume_name(name: str) -> str:
    """Return `name` if it is a valid volume name, else raise InvalidKey."""
    if not isinstance(name, str) or not _VOL_RE.fullmatch(name):
        raise InvalidKey(f"invalid volume name {name!r}: use 1-63 characters of "
                         f"[a-z0-9.-] starting with a letter or digit")
    return name


def check_inode(inode: int) -> int:
    if not isinstance(inode, int) or isinstance(inode, bool) or not 0 < inode <= MAX_INODE:
        raise InvalidKey(f"invalid inode {inode!r}: must be an integer in 1..2**63-1")
    return inode


@dataclass(frozen=True, slots=True, order=True)
class BlockKey:
    """A parsed block key. `str(key)` is the canonical form (and the file name)."""

    vol: str
    inode: int
    extent: int
    offset: int

    def __post_init__(self) -> None:
        check_volume_name(self.vol)
        check_inode(self.inode)
        for name, bits in (("extent", 8 * EXTENT_BYTES), ("offset", 64)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**bits:
                raise InvalidKey(f"invalid {name} {v!r}: must be an integer in 0..2**{bits}-1")

    @classmethod
    def parse(cls, text: str) -> BlockKey:
        """Parse the canonical form; raise InvalidKey (a ValueError) for anything else."""
        if not isinstance(text, str):
            raise InvalidKey(f"block key must be a string, not {type(text).__name__}")
        m = _KEY_RE.fullmatch(text)  # fullmatch: `$` alone accepts a trailing "\n"
        if m is None:
            shown = text if len(text) <= 120 else text[:120] + "..."
            raise InvalidKey(f"invalid block key {shown!r}: expected "
                             f"vol_inode_extent_offset (key format {KEY_FORMAT}), e.g. "
                             f"imagenet_42_{EXAMPLE_EXTENT}_0000000000400000")
        vol, inode, extent, offset = m.groups()
        inode_n = int(inode)
        if inode_n > MAX_INODE:
            raise InvalidKey(f"invalid block key {text!r}: inode {inode} is not below 2**63")
        return cls(vol, inode_n, int(extent, 16), int(offset, 16))

    def __str__(self) -> str:
        return f"{self.vol}_{self.inode}_{self.extent:032x}_{self.offset:016x}"


def is_block_name(name: str) -> bool:
    """Whether `BlockKey.parse(name)` would accept `name`, without building a
    BlockKey: the key pattern, and an inode below 2**63 (the pattern allows
    19 digits). The daemon's scan checks every file name with it, cheaper
    than a parse."""
    m = _KEY_RE.fullmatch(name)
    return m is not None and (len(m[2]) < 19 or int(m[2]) <= MAX_INODE)


def key_prefix(vol: str, inode: int | None = None) -> str:
    """The string every key of a volume (or of one inode in it) starts with.

    Used for range scans over a sorted index: `vol_` cannot be a prefix of
    another volume's keys because '_' is not allowed in volume names.
    """
    check_volume_name(vol)
    if inode is None:
        return f"{vol}_"
    return f"{vol}_{check_inode(inode)}_"


# Key format 2. Both ids are keyed BLAKE2b digests (person "blockcache-id",
# key = the volume's names key, below) of a label and then the id's parts,
# each part preceded by its length as 4 big-endian bytes:
#   inode  = H8(b"inode", path) & (2**63 - 1)       (moved off 0 and ROOT_INODE)
#   extent = H16(b"extent", path, version, str(block_size))
#   names key = HKDF-SHA256(volume key, salt=b"", info=NAMES_INFO)
# Every host with the volume key computes the same ids forever (tests pin
# known values); without the key they are opaque: listing keys or the cache
# tree confirms no guessed path, and two volumes with one name and
# different keys never share a block name. Format 1 (unkeyed, 16-digit
# extents) is refused by `BlockKey.parse`, so the daemon's scan removes
# such files at start.

NAMES_INFO = b"blockcache key names v2"


def names_key(volume_key: bytes) -> bytes:
    """The key block names are derived with: HKDF of the volume key, so it
    reveals nothing about the key that seals blocks."""
    from .blockfile import hkdf_sha256
    return hkdf_sha256(volume_key, b"", NAMES_INFO)


def _path_part(path: str) -> bytes:
    """The path's part of both ids: its length, then its bytes (surrogateescape
    keeps odd, non-UTF-8 names distinct and stable)."""
    p = path.strip("/").encode("utf-8", "surrogateescape")
    return len(p).to_bytes(4, "big") + p


class KeyNamer:
    """Derives a volume's block names (`inode`, `extent`) with its names key.

    The hash states after the label part are built once and copied per
    call, so a new reader process (which derives both ids of every file it
    opens) hashes only the parts that vary, with one update each."""

    __slots__ = ("_inode_seed", "_extent_seed", "_sizes")

    def __init__(self, volume_key: bytes):
        key = names_key(volume_key)
        self._inode_seed = self._seeded(key, b"inode", 8)
        self._extent_seed = self._seeded(key, b"extent", EXTENT_BYTES)
        self._sizes: dict[int, bytes] = {}  # block size -> its length-prefixed part

    @staticmethod
    def _seeded(key: bytes, label: bytes, size: int):
        h = hashlib.blake2b(digest_size=size, key=key, person=b"blockcache-id")
        h.update(len(label).to_bytes(4, "big") + label)
        return h

    def _inode(self, part: bytes) -> int:
        if len(part) == 4:  # the root: an empty path
            return ROOT_INODE
        h = self._inode_seed.copy()
        h.update(part)
        ino = int.from_bytes(h.digest(), "big") & MAX_INODE
        return ino if ino > ROOT_INODE else ino + 2

    def _extent_hash(self, part: bytes, version: str, block_size: int):
        """The extent's hash state over the path's `part`, the version and the block size."""
        size = self._sizes.get(block_size)
        if size is None:
            if len(self._sizes) >= 64:  # a volume has one block size: a handful per process
                self._sizes.clear()
            b = str(block_size).encode()
            size = self._sizes[block_size] = len(b).to_bytes(4, "big") + b
        v = version.encode("utf-8", "surrogateescape")
        h = self._extent_seed.copy()
        h.update(part + len(v).to_bytes(4, "big") + v + size)
        return h

    def inode(self, path: str) -> int:
        """Stable inode of a path inside the volume: the same on every host
        with the key, every restart."""
        return self._inode(_path_part(path))

    def extent(self, path: str, version: str, block_size: int) -> int:
        """Name one immutable version of a file's data.

        Derived from everything that could change a block's bytes: the file's
        version (ETag, or mtime_ns + size), the volume's block size, and the path
        (so even an inode-hash collision cannot alias two files' blocks).
        """
        return int.from_bytes(self._extent_hash(_path_part(path), version, block_size).digest(),
                              "big")

    def file_prefix(self, vol: str, path: str, version: str, block_size: int) -> str:
        """`{vol}_{inode}_{extent}_`, how every block key of one version of a
        file begins: `inode` and `extent` in one pass, the extent written as
        its digest's hex (the same digits as `format(extent, "032x")`). A new
        reader process computes this for every file it opens. `vol` must be a
        checked volume name."""
        part = _path_part(path)
        extent = self._extent_hash(part, version, block_size).hexdigest()
        return f"{vol}_{self._inode(part)}_{extent}_"

    def file_ids(self, path: str, version: str, block_size: int) -> tuple[int, int]:
        """(`inode(path)`, `extent(path, version, block_size)`), encoding the path once."""
        part = _path_part(path)
        return (self._inode(part),
                int.from_bytes(self._extent_hash(part, version, block_size).digest(), "big"))
