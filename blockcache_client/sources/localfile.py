"""Versioned ranged reads of local files: fstat, pread, fstat on one descriptor.

A local file has no ETag: its version is mtime_ns-size (`fileinfo.stat_version`),
and a range is of one version if the open file shows that version before and
after the read.
"""

from __future__ import annotations

import os

from .fileinfo import mtime_ns_of, stat_version
from .parts import read_parts


def read_if_version(full: str, start: int, end: int, version: str,
                    piece: int) -> list[bytes] | None:
    """Bytes [start, end) of a local file in `piece`-byte parts if it is
    `version` (as `file_info` computes it from fsspec's float mtime) before
    and after the read, else None."""
    def same(st: os.stat_result) -> bool:
        return stat_version(mtime_ns_of({'mtime': st.st_mtime}), st.st_size) == version
    fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if not same(os.fstat(fd)):
            return None
        parts = read_parts(lambda n, pos: os.pread(fd, n, pos), start, end, piece)
        if not same(os.fstat(fd)):
            return None
        return parts
    finally:
        os.close(fd)
