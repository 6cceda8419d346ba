"""Block keys: `{vol}_{inode}_{extent}_{offset}`, one canonical string form.

    vol     1-63 chars of [a-z0-9.-], starting with a letter or digit
    inode   decimal, 0 < inode < 2**63, no leading zeros
    extent  16 lowercase hex digits: one immutable version of the file's data
    offset  16 lowercase hex digits: the block's start offset in the file

Invariant: one key names exactly one byte string, forever. Parsing is strict:
anything that is not the canonical form is rejected, never "fixed", so a key
can never name a path outside the cache directory (no '/', '..', NUL, spaces).

The identity helpers at the bottom derive `inode` and `extent` so that every
host and every restart computes the same keys for the same bytes, and a changed
remote file gets new keys (its old blocks are never read again and age out).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from .errors import InvalidKey

MAX_INODE = 2**63 - 1
ROOT_INODE = 1  # FUSE's root; no file path hashes to it

_VOL = r"[a-z0-9][a-z0-9.-]{0,62}"
_VOL_RE = re.compile(rf"^{_VOL}$")
_KEY_RE = re.compile(rf"^({_VOL})_([1-9][0-9]{{0,18}})_([0-9a-f]{{16}})_([0-9a-f]{{16}})$")


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
        for name in ("extent", "offset"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**64:
                raise InvalidKey(f"invalid {name} {v!r}: must be an integer in 0..2**64-1")

    @classmethod
    def parse(cls, text: str) -> "BlockKey":
        """Parse the canonical form; raise InvalidKey (a ValueError) for anything else."""
        if not isinstance(text, str):
            raise InvalidKey(f"block key must be a string, not {type(text).__name__}")
        m = _KEY_RE.fullmatch(text)  # fullmatch: `$` alone accepts a trailing "\n"
        if m is None:
            shown = text if len(text) <= 120 else text[:120] + "..."
            raise InvalidKey(f"invalid block key {shown!r}: expected "
                             f"vol_inode_extent_offset, e.g. imagenet_42_00000000deadbeef_0000000000400000")
        vol, inode, extent, offset = m.groups()
        inode_n = int(inode)
        if inode_n > MAX_INODE:
            raise InvalidKey(f"invalid block key {text!r}: inode {inode} is not below 2**63")
        return cls(vol, inode_n, int(extent, 16), int(offset, 16))

    def __str__(self) -> str:
        return f"{self.vol}_{self.inode}_{self.extent:016x}_{self.offset:016x}"


def key_prefix(vol: str, inode: int | None = None) -> str:
    """The string every key of a volume (or of one inode in it) starts with.

    Used for range scans over a sorted index: `vol_` cannot be a prefix of
    another volume's keys because '_' is not allowed in volume names.
    """
    check_volume_name(vol)
    if inode is None:
        return f"{vol}_"
    return f"{vol}_{check_inode(inode)}_"


# Both ids are 64-bit BLAKE2b digests (person "blockcache-id") of a label and
# then the id's parts, each part preceded by its length as 4 big-endian bytes:
#   inode  = H(b"inode", path) & (2**63 - 1)       (moved off 0 and ROOT_INODE)
#   extent = H(b"extent", path, version, str(block_size))
# Every host must compute the same ids forever (tests pin known values).


def _seeded(label: bytes):
    """The hash state after the label part: copied per call, so a new reader
    process (which derives both ids of every file it opens) hashes only the
    parts that vary, with one update each."""
    h = hashlib.blake2b(digest_size=8, person=b"blockcache-id")
    h.update(len(label).to_bytes(4, "big") + label)
    return h


_INODE_SEED = _seeded(b"inode")
_EXTENT_SEED = _seeded(b"extent")
_SIZE_PARTS: dict[int, bytes] = {}  # block size -> its length-prefixed part


def _path_part(path: str) -> bytes:
    """The path's part of both ids: its length, then its bytes (surrogateescape
    keeps odd, non-UTF-8 names distinct and stable)."""
    p = path.strip("/").encode("utf-8", "surrogateescape")
    return len(p).to_bytes(4, "big") + p


def _inode(part: bytes) -> int:
    if len(part) == 4:  # the root: an empty path
        return ROOT_INODE
    h = _INODE_SEED.copy()
    h.update(part)
    ino = int.from_bytes(h.digest(), "big") & MAX_INODE
    return ino if ino > ROOT_INODE else ino + 2


def _extent_hash(part: bytes, version: str, block_size: int):
    """The extent's hash state over the path's `part`, the version and the block size."""
    size = _SIZE_PARTS.get(block_size)
    if size is None:
        if len(_SIZE_PARTS) >= 64:  # a volume has one block size: a handful per process
            _SIZE_PARTS.clear()
        b = str(block_size).encode()
        size = _SIZE_PARTS[block_size] = len(b).to_bytes(4, "big") + b
    v = version.encode("utf-8", "surrogateescape")
    h = _EXTENT_SEED.copy()
    h.update(part + len(v).to_bytes(4, "big") + v + size)
    return h


def inode_for_path(path: str) -> int:
    """Stable inode of a path inside a volume: the same on every host, every restart."""
    return _inode(_path_part(path))


def extent_for(path: str, version: str, block_size: int) -> int:
    """Name one immutable version of a file's data.

    Derived from everything that could change a block's bytes: the file's
    version (ETag, or mtime_ns + size), the volume's block size, and the path
    (so even an inode-hash collision cannot alias two files' blocks).
    """
    return int.from_bytes(_extent_hash(_path_part(path), version, block_size).digest(), "big")


def file_prefix(vol: str, path: str, version: str, block_size: int) -> str:
    """`{vol}_{inode}_{extent}_`, how every block key of one version of a file
    begins: `inode_for_path` and `extent_for` in one pass, the extent written
    as its digest's hex (the same 16 digits as `format(extent, "016x")`). A
    new reader process computes this for every file it opens. `vol` must be
    a checked volume name."""
    part = _path_part(path)
    return f"{vol}_{_inode(part)}_{_extent_hash(part, version, block_size).hexdigest()}_"


def file_ids(path: str, version: str, block_size: int) -> tuple[int, int]:
    """(`inode_for_path(path)`, `extent_for(path, version, block_size)`),
    encoding the path once."""
    part = _path_part(path)
    return (_inode(part),
            int.from_bytes(_extent_hash(part, version, block_size).digest(), "big"))
