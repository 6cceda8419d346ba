"""`Volume.open(path, "wb")`'s file object: a seekable binary stream staged, then uploaded whole.

Any write pattern works while it is open (sequential, seeks back, sparse
writes past the end, `truncate`); "w+b" reads its own bytes back. `close`
uploads the file as one object and returns once it is in the remote, or
raises OSError(EIO) (the staged bytes are then dropped: nothing of the file
is left anywhere); `fsync` uploads what is written so far and stays open.
Leaving a `with` block by an exception drops the file instead of uploading
it, and so does a file object collected without `close` (with a warning):
a half-written checkpoint never replaces a whole one.
"""

from __future__ import annotations

import errno
import io
import logging
import os

from ..sources.fileinfo import FileInfo
from .writes import WriteHandle

log = logging.getLogger(__name__)

MODES = {"wb": False, "w+b": True, "wb+": True}  # mode -> readable


class WriteFile(io.RawIOBase):
    """One file of a volume being written (see the module doc)."""

    def __init__(self, handle: WriteHandle, mode: str):
        self._handle = handle
        self.name = handle.rel
        self.mode = mode
        self._readable = MODES[mode]
        self._pos = 0
        self.info: FileInfo | None = None  # the uploaded version, once closed

    def readable(self) -> bool:
        return self._readable

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def _check(self) -> None:
        if self.closed:
            raise ValueError(f"I/O operation on closed file {self.name}")

    def tell(self) -> int:
        self._check()
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._check()
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._handle.size}
        if whence not in base:
            raise ValueError(f"seek {self.name}: invalid whence {whence}")
        pos = base[whence] + offset
        if pos < 0:
            raise OSError(errno.EINVAL, f"seek {self.name}: negative position {pos}")
        self._pos = pos
        return pos

    def write(self, data) -> int:
        self._check()
        n = self._handle.write(self._pos, data)
        self._pos += n
        return n

    def readinto(self, buffer) -> int:
        self._check()
        if not self._readable:
            raise io.UnsupportedOperation(f"{self.name} was opened {self.mode!r}: "
                                          f"open it 'w+b' to read it back")
        view = memoryview(buffer).cast("B")
        got = self._handle.read(self._pos, len(view))
        view[:len(got)] = got
        self._pos += len(got)
        return len(got)

    def truncate(self, size: int | None = None) -> int:
        self._check()
        size = self._pos if size is None else size
        self._handle.truncate(size)
        return size

    def fsync(self) -> FileInfo | None:
        """Upload what is written so far (as `os.fsync` on a mount does)."""
        self._check()
        self.info = self._handle.commit()
        return self.info

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.info = self._handle.close()
        finally:
            super().close()

    def discard(self) -> None:
        """Close without uploading: the staged bytes are dropped."""
        if not self.closed:
            self._handle.release()
            super().close()

    def __exit__(self, kind, *rest) -> None:
        if kind is not None:
            self.discard()
        else:
            self.close()

    def __del__(self) -> None:
        if not self.closed:
            log.warning("%s was collected without close(): dropped, not uploaded", self.name)
            self.discard()
