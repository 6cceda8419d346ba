"""The write handlers of a writable mount: a mixin of `fs.BlockcacheFS`.

Each is a few lines over the volume's writes (`Volume.open_staged`, mkdir,
rmdir, unlink, rename; `writer/` does the staging and the uploads) and
`writefiles.WriteFiles`, keeping the mount's caches true to what changed:

- CREATE, and OPEN with write flags: a staged file, new or emptied
  (O_TRUNC). An existing non-empty file opened to write without O_TRUNC is
  EOPNOTSUPP: a file of the volume is written whole (`writer.writes`).
- WRITE, READ and SETATTR of the size on a write handle: its staged bytes.
  A stat of a file being written here answers its staged size.
- FLUSH (each close) and FSYNC: the upload, answered once the object is in
  the remote, or EIO. Then the attribute cache holds the new version and
  its directory's listing is dropped, so an open on this mount after the
  close sees the new version (close-to-open), whatever the TTL.
- MKDIR, RMDIR, UNLINK, RENAME and RENAME2 (RENAME_NOREPLACE; an exchange
  is EINVAL): the volume's, then the caches, and the inode table follows
  a rename (`InodeTable.moved`).
- SETATTR of times is ignored (a file's times are the remote's); of mode
  or owner, EPERM.

Every wait on the source or an upload is inside the session's `blocking`.
"""

from __future__ import annotations

import errno
import os
import time

from blockcache_client import FileInfo

from .errors import fuse_op
from .handleids import is_write_handle
from .session import Attributes, FuseError
from .session import structs as s
from .writefiles import WriteOpen

_WRITE_ACCESS = os.O_WRONLY | os.O_RDWR
_LOCK_WAIT = 0.01  # a write waiting longer for its staged file's lock (an upload) hands off


class WriteHandlers:
    """The write handlers `BlockcacheFS` has when its mount is writable."""

    def _child(self, parent_inode: int, name: bytes) -> str:
        parent = self.nodes.path(parent_inode)
        sname = os.fsdecode(name)
        if sname in (".", "..") or "/" in sname or not sname:
            raise FuseError(errno.EINVAL)
        return f"{parent}/{sname}" if parent else sname

    def _entry(self, info: FileInfo) -> Attributes:
        """The node of `info`'s path, its lookup counted, and its attributes."""
        inode = self.nodes.inode_of(info.path)
        if inode not in self.nodes:
            self.pruner.wait_for_room()
        gen = self.nodes.gen_of(inode, info.path)
        if self.nodes.remember(info.path, info.size, inode) is None:
            raise FuseError(errno.EIO)
        attrs = self._attrs(info, inode)
        attrs.generation = gen
        return attrs

    def _changed(self, path: str, info: FileInfo | None, tree: bool = False) -> None:
        self.meta.changed(path, info, tree)

    @fuse_op()
    def create(self, parent: int, name: bytes, flags: int, mode: int) -> tuple[Attributes, int]:
        path = self._child(parent, name)
        with self.blocking():
            handle = self.volume.open_staged(path, truncate=True, checked=True)
        try:
            attrs = self._entry(self.writes.staged(path))
            node = self.nodes[attrs.st_ino]
            fh = self.writes.adopt(handle, path, attrs.st_ino, node)
        except BaseException:
            handle.release()
            raise
        self.nodes.opened(node)
        self._changed(path, None)
        return attrs, fh

    def open_write(self, inode: int, flags: int) -> tuple[int, bool]:
        """OPEN with write flags (see `fs.BlockcacheFS.open`)."""
        node = self.nodes.node(inode)
        with self.blocking():
            fh = self.writes.open(node.path, inode, node, truncate=bool(flags & os.O_TRUNC))
        self.nodes.opened(node)
        return fh, False

    def _open_of(self, fh: int) -> WriteOpen:
        return self.writes.get(fh)

    @fuse_op()
    def write(self, fh: int, off: int, data: memoryview) -> int:
        w = self._open_of(fh)
        lock = w.handle.staged.lock
        if not lock.acquire(timeout=_LOCK_WAIT):  # an upload of it is under way
            with self.blocking():
                lock.acquire()
        try:
            return w.handle.write(off, data)
        finally:
            lock.release()

    def read_staged(self, fh: int, off: int, size: int) -> bytearray:
        return self._open_of(fh).handle.read(off, size)

    @fuse_op()
    def flush(self, fh: int) -> None:
        if is_write_handle(fh):
            self._commit(self._open_of(fh))

    @fuse_op()
    def fsync(self, fh: int) -> None:
        if is_write_handle(fh):
            self._commit(self._open_of(fh))

    def _commit(self, w: WriteOpen) -> None:
        with self.blocking():
            info = w.handle.commit()
        self._changed(w.path, info)
        if info is not None:
            self.nodes.set_size(w.inode, w.node, info.size)

    def release_write(self, fh: int) -> None:
        w = self.writes.release(fh)
        if w is not None:
            self.nodes.closed(w.inode, w.node)

    @fuse_op()
    def setattr(self, inode: int, valid: int, fh: int, size: int) -> Attributes:
        if valid & (s.FATTR_MODE | s.FATTR_UID | s.FATTR_GID):
            raise FuseError(errno.EPERM)
        path = self.nodes.path(inode)
        if valid & s.FATTR_SIZE:
            staged = self.writes.staged(path)
            if staged is None and size:
                raise OSError(errno.EOPNOTSUPP, f"truncate {path} to {size} bytes: only a "
                                                f"file being written, or to 0 bytes")
            with self.blocking():
                handle = self.volume.open_staged(path, truncate=staged is None, checked=True)
                try:
                    handle.truncate(size)
                    info = handle.commit() if staged is None else None
                finally:
                    handle.release()
            if info is not None:
                self._changed(path, info)
        return self.getattr(inode)

    @fuse_op()
    def mkdir(self, parent: int, name: bytes, mode: int) -> Attributes:
        path = self._child(parent, name)
        with self.blocking():
            self.volume.mkdir(path)
        info = FileInfo(path=path, name=path.rpartition("/")[2], size=0, is_dir=True,
                        is_link=False, mtime_ns=time.time_ns(), version="")
        self._changed(path, info)
        return self._entry(info)

    @fuse_op()
    def rmdir(self, parent: int, name: bytes) -> None:
        path = self._child(parent, name)
        with self.blocking():
            self.volume.rmdir(path)
        self._changed(path, None, tree=True)
        self.meta.put_negative(path)

    @fuse_op()
    def unlink(self, parent: int, name: bytes) -> None:
        path = self._child(parent, name)
        with self.blocking():
            self.volume.unlink(path)
        self._changed(path, None)
        self.meta.put_negative(path)

    @fuse_op()
    def rename(self, parent: int, name: bytes, newparent: int, newname: bytes,
               flags: int) -> None:
        if flags & ~s.RENAME_NOREPLACE:
            raise FuseError(errno.EINVAL)  # RENAME_EXCHANGE, RENAME_WHITEOUT
        src, dst = self._child(parent, name), self._child(newparent, newname)
        with self.blocking():
            if flags & s.RENAME_NOREPLACE and self._exists(dst):
                raise FuseError(errno.EEXIST)
            staged = self.writes.staged(src) is not None  # renamed while open (safetensors)
            is_dir = not staged and self.volume.stat(src, max_age=0).is_dir
            self.volume.rename(src, dst)
        self._changed(src, None, tree=is_dir)
        self._changed(dst, None, tree=is_dir)
        self.meta.put_negative(src)
        self.nodes.moved(src, dst)
        self.writes.moved(src, dst)

    def _exists(self, path: str) -> bool:
        try:
            self.volume.stat(path, max_age=0)
        except FileNotFoundError:
            return False
        return True

    def staged_attrs(self, path: str) -> FileInfo | None:
        """The FileInfo of `path` if a write handle of it is open here."""
        return self.writes.staged(path) if self.writes is not None else None

    def writable_statfs(self) -> bytes:
        """statfs of a writable mount: the staging bound as its size, what is
        left of it as free (`df`, and writers that check for room)."""
        stats = self.volume.stats()
        bsize = 4096
        total = self.cfg.staging_bytes // bsize
        free = max(0, total - stats.get("staging_used_bytes", 0) // bsize)
        return s.pack_statfs(blocks=total, bfree=free, bavail=free, files=len(self.nodes),
                             ffree=1 << 20, bsize=bsize, namelen=255, frsize=bsize)
