"""`Volume.open()`'s file object: a seekable, read-only binary stream.

Pinned to the FileInfo seen at open, so every read of one open file comes
from one version (a rewrite mid-read gives ESTALE, never a mix of versions).
Behaves like an unbuffered `io.RawIOBase` file, which is what PIL.Image.open,
numpy.load and tarfile need; wrap it in `io.BufferedReader` for many tiny reads.
Closing it, or seeking elsewhere, cancels the read-ahead of its file
(`sequential`): a reader that stops mid-file leaves no fetches queued.
A file opened by its first block's GET (`coldopen`) serves its
first read from those bytes when the read lies within that block, counted
as the miss it is.
"""

from __future__ import annotations

import io
import os

from ..sources.fileinfo import FileInfo
from .handlehits import HandleBlocks
from .hits import deliver


class VolumeFile(io.RawIOBase):
    """Read-only view of one file version in a `Volume`."""

    def __init__(self, volume, path: str, info: FileInfo, first: bytes | None = None):
        # no super().__init__(): io.RawIOBase has no state to set up, and a
        # dataset makes one of these per file it reads
        self._volume = volume
        self.name = path
        self.info = info
        self.size = info.size
        self._pos = 0
        # block files kept open for this handle's reads, and its repeat hits' short path
        self._blocks = HandleBlocks(volume, path, info)
        self._first = first  # block 0's bytes from the open's GET, until the first read

    def close(self) -> None:
        self._first = None
        if not self.closed:
            self._cancel_ahead()
        self._blocks.close(self._volume._files)
        super().close()

    def _cancel_ahead(self) -> None:
        vol = self._volume
        vol._sequential.cancel(vol._key_prefix(self.name, self.info.version))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        self._check_closed()
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._check_closed()
        if whence == os.SEEK_SET:
            pos = offset
        elif whence == os.SEEK_CUR:
            pos = self._pos + offset
        elif whence == os.SEEK_END:
            pos = self.size + offset
        else:
            raise ValueError(f"seek {self.name}: invalid whence {whence}")
        if pos < 0:
            raise OSError(22, f"seek {self.name}: negative position {pos}")
        if pos != self._pos:
            self._cancel_ahead()
        self._pos = pos
        return pos

    def read(self, size: int = -1) -> bytes:
        if self.closed:  # `_check_closed`, inline: a whole-file read is one call
            raise ValueError(f"I/O operation on closed file {self.name}")
        if size is None or size < 0:
            size = max(0, self.size - self._pos)
        if self._first is not None:
            data = self._read_first(size, None)
            if data is not None:
                self._pos += len(data)
                return data
        data = self._blocks.read(self._pos, size, None)
        if data is None:
            data = self._volume._read_pinned(self.name, self._pos, size, self.info, None,
                                             self._blocks)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer) -> int:
        self._check_closed()
        view = memoryview(buffer).cast("B")
        if self._first is not None:
            n = self._read_first(len(view), view)
            if n is not None:
                self._pos += n
                return n
        n = self._blocks.read(self._pos, len(view), view)
        if n is None:
            n = self._volume._read_pinned(self.name, self._pos, len(view), self.info, view,
                                          self._blocks)
        self._pos += n
        return n

    def _read_first(self, size: int, out: memoryview | None):
        """The first read, from the open's block 0 if it lies within it (bytes,
        or their count stored in `out`), counted as a miss; else None, for
        the read path (the block is in the memory LRU too)."""
        data, self._first = self._first, None
        end = min(self._pos + size, self.size)
        if self._pos >= end or end > len(data):
            return None
        self._volume.counters.add2("misses", "miss_bytes", end - self._pos)
        return deliver(data, self._pos, end, out)

    def _check_closed(self) -> None:
        if self.closed:
            raise ValueError(f"I/O operation on closed file {self.name}")
