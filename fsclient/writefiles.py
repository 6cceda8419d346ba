"""A writable mount's open write handles: each a staged file of the volume.

`open` stages a file through the volume (`Volume.open_staged`: new, or
truncated; one staged file per path, shared by every handle of it here) and
hands out a write handle number (`handleids.WRITE_TAG`). Its writes,
reads, truncates and commits (FLUSH on each close, FSYNC) go to that
staged file; RELEASE lets go of it. A handle number this server did not
hand out (a server before it opened it, and its staged bytes died with it)
is EIO: the writer learns its file was not saved.
"""

from __future__ import annotations

import errno
import threading
import time

from blockcache_client import FileInfo, Volume

from .handleids import WRITE_TAG, HandleNumbers
from .inodes import Node
from .session import FuseError


class WriteOpen:
    """One open for writing: the volume's write handle, and the node it is of."""

    __slots__ = ("handle", "path", "inode", "node")

    def __init__(self, handle, path: str, inode: int, node: Node):
        self.handle = handle  # the volume's `WriteHandle`
        self.path = path
        self.inode = inode
        self.node = node


class WriteFiles:
    """The mount's write handles (thread-safe: one lock over the table)."""

    def __init__(self, volume: Volume):
        self.volume = volume
        self.handles: dict[int, WriteOpen] = {}
        self._numbers = HandleNumbers()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.handles)

    def open(self, path: str, inode: int, node: Node, truncate: bool) -> int:
        """A write handle of `path` (staged empty if `truncate`)."""
        handle = self.volume.open_staged(path, truncate=truncate, checked=True)
        return self.adopt(handle, path, inode, node)

    def adopt(self, handle, path: str, inode: int, node: Node) -> int:
        """The number of a new write handle of the volume's `handle`."""
        with self._lock:
            fh = self._numbers.next(WRITE_TAG, self.handles)
            self.handles[fh] = WriteOpen(handle, path, inode, node)
        return fh

    def get(self, fh: int) -> WriteOpen:
        """The open of `fh`; EIO for one this server never opened."""
        found = self.handles.get(fh)
        if found is None:
            raise FuseError(errno.EIO)
        return found

    def release(self, fh: int) -> WriteOpen | None:
        with self._lock:
            found = self.handles.pop(fh, None)
        if found is not None:
            found.handle.release()
        return found

    def moved(self, src: str, dst: str) -> None:
        """A file open here for writing was renamed: its handles follow it."""
        with self._lock:
            for w in self.handles.values():
                if w.path == src:
                    w.path = dst

    def staged(self, path: str) -> FileInfo | None:
        """What a stat of `path` answers while it is staged here: its staged
        size, now as its mtime; None if no handle of it is open."""
        size = self.volume.staged_size(path)
        if size is None:
            return None
        return FileInfo(path=path, name=path.rpartition("/")[2], size=size, is_dir=False,
                        is_link=False, mtime_ns=time.time_ns(), version="staged")
