"""`Volume.open()`'s file object: a seekable, read-only binary stream.

Pinned to the FileInfo seen at open, so every read of one open file comes
from one version (a rewrite mid-read gives ESTALE, never a mix of versions).
Behaves like an unbuffered `io.RawIOBase` file, which is what PIL.Image.open,
numpy.load and tarfile need; wrap it in `io.BufferedReader` for many tiny reads.
Its reads go through its open handle (`handle.FileHandle`: the version,
the sequential detector, the held block files); closing it, or seeking
elsewhere, cancels its read-ahead: a reader that stops mid-file leaves no
fetches queued.
"""

from __future__ import annotations

import io
import os

from .handle import FileHandle


class VolumeFile(io.RawIOBase):
    """Read-only view of one file version in a `Volume`."""

    def __init__(self, handle: FileHandle):
        # no super().__init__(): io.RawIOBase has no state to set up, and a
        # dataset makes one of these per file it reads
        self._handle = handle
        self.name = handle.rel
        self.info = handle.info
        self.size = handle.size
        self._pos = 0

    def close(self) -> None:
        self._handle.close()
        super().close()

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
            self._handle.cancel_ahead()
        self._pos = pos
        return pos

    def read(self, size: int = -1) -> bytes:
        if self.closed:  # `_check_closed`, inline: a whole-file read is one call
            raise ValueError(f"I/O operation on closed file {self.name}")
        if size is None or size < 0:
            size = max(0, self.size - self._pos)
        data = self._handle.read(self._pos, size)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer) -> int:
        self._check_closed()
        view = memoryview(buffer).cast("B")
        n = self._handle.read(self._pos, len(view), view)
        self._pos += n
        return n

    def _check_closed(self) -> None:
        if self.closed:
            raise ValueError(f"I/O operation on closed file {self.name}")
