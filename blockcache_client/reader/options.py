"""A `Volume`'s read options, checked once, and the sizes that follow from them.

Bad values fail at construction (or at the call), naming the volume or the
path and the range a value must be in.
"""

from __future__ import annotations

import errno

from ..contract import blockfile
from ..contract.errors import ConfigError

MAX_OFFSET = 2**63 - 1
# Most bytes one sequential request asks the source for: each request to S3
# costs tens of ms whatever its size, so a sequential reader is served with
# few large requests.
COALESCE_BYTES = 32 << 20
# ...and that window comes in parts of this size (Mountpoint's default part),
# fetched in parallel: a reader waits for its first part only
PART_BYTES = 8 << 20
# Seconds a block handed to the daemon may take to reach its path: a host
# fill (`hostfill`) and a handle waiting to hold the file (`handlehits`)
WRITE_WAIT = 10.0


def check_block_size(name: str, block_size: object) -> int:
    """`block_size`, if it is an int a block file can hold; else ConfigError."""
    if (not isinstance(block_size, int) or isinstance(block_size, bool)
            or not blockfile.MIN_CHUNK <= block_size <= blockfile.MAX_PLAINTEXT):
        raise ConfigError(f"volume {name}: block size {block_size!r} must be an integer "
                          f"in {blockfile.MIN_CHUNK}..{blockfile.MAX_PLAINTEXT}")
    return block_size


def chunk_size(block_size: int) -> int:
    """The chunk size blocks of `block_size` are sealed in (at most the default)."""
    return min(blockfile.DEFAULT_CHUNK, 1 << (block_size.bit_length() - 1))


def window(block_size: int, memory_cache_bytes: int) -> int:
    """Blocks one sequential request may bring: two windows (the one being
    read, the one fetched ahead) fit in the memory LRU; 1 = no coalescing."""
    return max(1, min(COALESCE_BYTES // block_size,
                      max(0, memory_cache_bytes) // (2 * block_size)))


def buffer_bytes(memory_cache_bytes: int) -> int:
    """Bytes of block buffers a volume keeps for cold blocks of large files
    (`fetch`, `common.bufferpool`): those the LRU holds, plus as many for the
    window in flight and the fill queue (a window is at most half the LRU)."""
    return 2 * max(0, memory_cache_bytes)


def part_blocks(block_size: int) -> int:
    """Blocks one request of a sequential window brings (at least one)."""
    return max(1, PART_BYTES // block_size)


def check_range(path: str, offset: object, size: object) -> None:
    """TypeError or EINVAL unless `offset` and `size` are ints in 0..2**63-1."""
    for what, v in (("offset", offset), ("size", size)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"read {path}: {what} must be an int, not {type(v).__name__}")
        if not 0 <= v <= MAX_OFFSET:
            raise OSError(errno.EINVAL, f"read {path}: {what} {v} is outside 0..2**63-1")
