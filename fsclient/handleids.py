"""Handle numbers that describe what their handle is pinned to, so that a server
which took a live mount over can go on with handles opened before it.

A file or directory handle number (`fh`, 64 bits, which the kernel sends back
with every read, readdir and release, beside the node id) is

    bits 63..16  TAG: 48 bits of a BLAKE2b hash of what the handle pins:
                 a file's path and version (size and the version string),
                 or a directory snapshot's names in order
    bits 15..0   a serial number, making each open's number unique

A write handle's tag is WRITE_TAG (0, which no hash tag is): what it pins
is staged in the server that opened it, and goes with it.

A successor that gets a number it never handed out finds the node's path from
the saved state, asks the source for the file's version (or lists the
directory) and compares tags: equal, it makes the handle again, pinned to the
same version (so no read mixes versions, and readdir offsets index the same
names); different, the read gets ESTALE, never other bytes. Two different
versions share a tag with odds of 2**-48.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Container, Iterable

from blockcache_client.sources.fileinfo import FileInfo

SERIAL_BITS = 16
SERIAL_MASK = (1 << SERIAL_BITS) - 1
WRITE_TAG = 0  # the tag of every write handle (`is_write_handle`)


def _tag(parts: Iterable[str]) -> int:
    h = hashlib.blake2b(digest_size=6)
    for p in parts:
        h.update(p.encode("utf-8", "surrogateescape"))
        h.update(b"\0")
    return int.from_bytes(h.digest(), "little") or 1  # (0 is WRITE_TAG)


def file_tag(info: FileInfo) -> int:
    """The tag of an open pinned to `info`'s version."""
    return _tag((info.path, str(info.size), info.version))


def listing_tag(entries: Iterable[FileInfo]) -> int:
    """The tag of a directory snapshot: its names, in their order."""
    return _tag(e.name for e in entries)


def tag_of(fh: int) -> int:
    return fh >> SERIAL_BITS


def is_write_handle(fh: int) -> bool:
    """A handle open for writing (a staged file), not a pinned version."""
    return fh >> SERIAL_BITS == WRITE_TAG


class HandleNumbers:
    """Hands out numbers: tag and a serial, none equal to a number in use."""

    def __init__(self) -> None:
        self._serial = itertools.count(1)
        self._lock = threading.Lock()

    def next(self, tag: int, in_use: Container[int]) -> int:
        with self._lock:
            while True:
                fh = (tag << SERIAL_BITS) | (next(self._serial) & SERIAL_MASK)
                if fh not in in_use and fh != 0:
                    return fh
