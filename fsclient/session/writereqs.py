"""The requests a writable mount serves: decoded, handed to the file system, answered.

CREATE, WRITE, FLUSH, FSYNC, SETATTR, MKDIR, UNLINK, RMDIR, RENAME and
RENAME2, each decoded from the body its worker read and answered on the
same channel (`requests.Dispatcher` adds them to its table for a writable
session; a read-only one answers them EROFS). A body too short for its
struct, or a name without its NUL, raises `struct.error`, which the
dispatcher answers EINVAL.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Protocol

from . import structs as s
from .channel import Channel


class WriteOperations(Protocol):
    """The file system's write handlers (`fs.BlockcacheFS`, writable)."""

    def create(self, parent: int, name: bytes, flags: int, mode: int
               ) -> tuple[s.Attributes, int]: ...
    def write(self, fh: int, off: int, data: memoryview) -> int: ...
    def flush(self, fh: int) -> None: ...
    def fsync(self, fh: int) -> None: ...
    def setattr(self, inode: int, valid: int, fh: int, size: int) -> s.Attributes: ...
    def mkdir(self, parent: int, name: bytes, mode: int) -> s.Attributes: ...
    def unlink(self, parent: int, name: bytes) -> None: ...
    def rmdir(self, parent: int, name: bytes) -> None: ...
    def rename(self, parent: int, name: bytes, newparent: int, newname: bytes,
               flags: int) -> None: ...
    def release(self, fh: int) -> None: ...


def names(body: memoryview, count: int) -> list[bytes]:
    """The `count` NUL-terminated names `body` starts with."""
    raw = bytes(body)
    out, pos = [], 0
    for _ in range(count):
        end = raw.find(b"\0", pos)
        if end < 0:
            raise struct.error("a name without its NUL")
        out.append(raw[pos:end])
        pos = end + 1
    return out


Handler = Callable[[Channel, int, int, memoryview, int], None]


class WriteRequests:
    """The decoders of a writable session's write requests."""

    def __init__(self, ops: WriteOperations):
        self.ops = ops

    def table(self) -> dict[int, Handler]:
        return {s.CREATE: self._create, s.WRITE: self._write, s.FLUSH: self._flush,
                s.FSYNC: self._fsync, s.SETATTR: self._setattr, s.MKDIR: self._mkdir,
                s.UNLINK: self._unlink, s.RMDIR: self._rmdir, s.RENAME: self._rename,
                s.RENAME2: self._rename2}

    def _create(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                uid: int) -> None:
        flags, mode, _umask, _open_flags = s.CREATE_IN.unpack_from(body)
        (name,) = names(body[s.CREATE_IN.size:], 1)
        attrs, fh = self.ops.create(nodeid, name, flags, mode)
        # a write handle: every read and write comes here (the page cache holds
        # none of its staged bytes), and each close flushes (uploads)
        out = s.pack_entry(attrs) + s.OPEN_OUT.pack(fh, s.FOPEN_DIRECT_IO, 0)
        if not ch.reply(unique, (out,)):
            self.ops.release(fh)  # interrupted and answered: the kernel never saw fh

    def _write(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
               uid: int) -> None:
        fh, off, size = s.WRITE_IN.unpack_from(body)[:3]
        data = body[s.WRITE_IN.size:s.WRITE_IN.size + size]
        if len(data) != size:
            raise struct.error(f"a write of {size} bytes carries {len(data)}")
        n = self.ops.write(fh, off, data)
        ch.reply(unique, (s.WRITE_OUT.pack(n, 0),))

    def _flush(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
               uid: int) -> None:
        self.ops.flush(s.FLUSH_IN.unpack_from(body)[0])
        ch.reply(unique)

    def _fsync(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
               uid: int) -> None:
        self.ops.fsync(s.FSYNC_IN.unpack_from(body)[0])
        ch.reply(unique)

    def _setattr(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                 uid: int) -> None:
        valid, _, fh, size = s.SETATTR_IN.unpack_from(body)[:4]
        ch.reply(unique, (s.pack_attr_out(self.ops.setattr(nodeid, valid, fh, size)),))

    def _mkdir(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
               uid: int) -> None:
        mode = s.MKDIR_IN.unpack_from(body)[0]
        (name,) = names(body[s.MKDIR_IN.size:], 1)
        ch.reply(unique, (s.pack_entry(self.ops.mkdir(nodeid, name, mode)),))

    def _unlink(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                uid: int) -> None:
        self.ops.unlink(nodeid, names(body, 1)[0])
        ch.reply(unique)

    def _rmdir(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
               uid: int) -> None:
        self.ops.rmdir(nodeid, names(body, 1)[0])
        ch.reply(unique)

    def _rename(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                uid: int) -> None:
        newdir = s.RENAME_IN.unpack_from(body)[0]
        old, new = names(body[s.RENAME_IN.size:], 2)
        self.ops.rename(nodeid, old, newdir, new, 0)
        ch.reply(unique)

    def _rename2(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                 uid: int) -> None:
        newdir, flags, _ = s.RENAME2_IN.unpack_from(body)
        old, new = names(body[s.RENAME2_IN.size:], 2)
        self.ops.rename(nodeid, old, newdir, new, flags)
        ch.reply(unique)
