"""Requests: each one decoded from the buffer it was read into, handed to the file
system's handler, and answered on the channel it came from.

`Operations` is what the file system implements: plain synchronous methods, called
on the worker thread that read the request. A handler answers by returning; it
refuses with `FuseError(errno)`; any other exception is a bug answered with EIO
and logged (the session goes on). On a read-only mount requests that write
answer EROFS; on a writable one `writereqs` serves them, and those it does
not (links, xattrs, fallocate) answer EOPNOTSUPP. Unknown requests answer
ENOSYS, and a request too short for its opcode's struct EINVAL, all without
calling the file system.
"""

from __future__ import annotations

import errno
import logging
import struct
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Protocol

from ..handleids import is_write_handle
from . import structs as s
from .channel import Channel
from .writereqs import WriteRequests

log = logging.getLogger(__name__)

_READ_HEAD = struct.Struct("<QQI")  # fuse_read_in's fh, offset and size
_NO_ENTRY = bytes(s.ENTRY_SIZE)  # a readdirplus entry_out of node id 0


class FuseError(Exception):
    """A handler's refusal: answered with -errno."""

    def __init__(self, code: int):
        super().__init__(code)
        self.errno = code


class DirReply:
    """A READDIR(PLUS) reply being filled: entries until the kernel's size (one
    buffer: a reply of many entries would exceed writev's IOV_MAX in parts)."""

    __slots__ = ("buf", "left", "plus")

    def __init__(self, size: int, plus: bool):
        self.buf = bytearray()
        self.left = size
        self.plus = plus

    def add(self, name: bytes, attrs: s.Attributes, next_off: int, bare: bool = False) -> bool:
        """Add one entry; False (and nothing added) if it does not fit. A
        `bare` readdirplus entry has node id 0: the kernel takes no lookup of
        it (and makes no dentry), and looks the name up when it is used."""
        need = s.dirent_size(name, self.plus)
        if need > self.left:
            return False
        self.left -= need
        if self.plus:
            self.buf += _NO_ENTRY if bare else s.pack_entry(attrs)
        self.buf += s.pack_dirent(name, attrs.st_ino, next_off, attrs.st_mode)
        return True


class Operations(Protocol):
    """The file system's handlers (`fs.BlockcacheFS`)."""

    def lookup(self, parent: int, name: bytes) -> s.Attributes: ...
    def forget(self, items: Iterable[tuple[int, int]]) -> None: ...
    def getattr(self, inode: int) -> s.Attributes: ...
    def readlink(self, inode: int) -> bytes: ...
    def open(self, inode: int, flags: int) -> tuple[int, bool]: ...
    def read(self, fh: int, off: int, size: int, inode: int) -> bytes | memoryview: ...
    def answering(self, fh: int, inode: int) -> AbstractContextManager[None]: ...
    def release(self, fh: int) -> None: ...
    def opendir(self, inode: int) -> int: ...
    def readdir(self, fh: int, off: int, out: DirReply, inode: int) -> None: ...
    def releasedir(self, fh: int) -> None: ...
    def statfs(self) -> bytes: ...
    def getxattr(self, inode: int, name: bytes, uid: int) -> bytes: ...
    def listxattr(self, inode: int) -> list[bytes]: ...
    def access(self, inode: int, mask: int) -> None: ...


def _name(body: memoryview) -> bytes:
    """The NUL-terminated name a request body starts with."""
    raw = bytes(body)
    end = raw.find(b"\0")
    if end < 0:
        raise FuseError(errno.EINVAL)
    return raw[:end]


class Dispatcher:
    """Decodes the requests of one session and calls its file system."""

    def __init__(self, ops: Operations, writable: bool = False):
        self.ops = ops
        self.writable = writable
        self.table: dict[int, Callable[[Channel, int, int, memoryview, int], None]] = {
            s.LOOKUP: self._lookup, s.GETATTR: self._getattr, s.READLINK: self._readlink,
            s.OPEN: self._open, s.READ: self._read, s.RELEASE: self._release,
            s.OPENDIR: self._opendir, s.READDIR: self._readdir, s.READDIRPLUS: self._readdirplus,
            s.RELEASEDIR: self._releasedir, s.STATFS: self._statfs,
            s.GETXATTR: self._getxattr, s.LISTXATTR: self._listxattr, s.ACCESS: self._access,
            s.FLUSH: self._flush, s.FORGET: self._forget, s.BATCH_FORGET: self._batch_forget,
        }
        if writable:
            self.table.update(WriteRequests(ops).table())  # type: ignore[arg-type]
        # what a write request this session does not serve is answered
        self._unserved_write = errno.EOPNOTSUPP if writable else errno.EROFS

    def call(self, op: int, ch: Channel, unique: int, nodeid: int, body: memoryview,
             uid: int) -> None:
        """Serve one request whose header was checked: answer it (or not, for
        forgets) on `ch`. Never raises."""
        handler = self.table.get(op)
        try:
            if handler is None:
                ch.error(unique, self._unserved_write if op in s.WRITE_OPS else errno.ENOSYS)
                return
            handler(ch, unique, nodeid, body, uid)
        except FuseError as exc:
            ch.error(unique, exc.errno)
        except struct.error:
            log.warning("%s request %d: its body (%d bytes) is too short; answering EINVAL",
                        s.OP_NAMES.get(op, op), unique, len(body))
            ch.error(unique, errno.EINVAL)
        except Exception:
            log.exception("%s request %d failed; answering EIO", s.OP_NAMES.get(op, op), unique)
            ch.error(unique, errno.EIO)

    def _flush(self, ch: Channel, unique: int, nodeid: int, body: memoryview, uid: int) -> None:
        # Nothing is written, so nothing to flush. Kernels before 7.35 ignore
        # FOPEN_NOFLUSH and flush at every close; ENOSYS makes them stop
        # (no_flush, and the close succeeds), a request less per file.
        s.FLUSH_IN.unpack_from(body)
        ch.error(unique, errno.ENOSYS)

    def _lookup(self, ch: Channel, unique: int, nodeid: int, body: memoryview, uid: int) -> None:
        ch.reply(unique, (s.pack_entry(self.ops.lookup(nodeid, _name(body))),))

    def _forget(self, ch: Channel, unique: int, nodeid: int, body: memoryview, uid: int) -> None:
        self.ops.forget(((nodeid, s.FORGET_IN.unpack_from(body)[0]),))

    def _batch_forget(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                      uid: int) -> None:
        count = s.BATCH_FORGET_IN.unpack_from(body)[0]
        start = s.BATCH_FORGET_IN.size
        count = min(count, (len(body) - start) // s.FORGET_ONE.size)
        self.ops.forget([s.FORGET_ONE.unpack_from(body, start + i * s.FORGET_ONE.size)
                         for i in range(count)])

    def _getattr(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                 uid: int) -> None:
        ch.reply(unique, (s.pack_attr_out(self.ops.getattr(nodeid)),))

    def _readlink(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                  uid: int) -> None:
        ch.reply(unique, (self.ops.readlink(nodeid),))

    def _open(self, ch: Channel, unique: int, nodeid: int, body: memoryview, uid: int) -> None:
        flags = s.OPEN_IN.unpack_from(body)[0]
        fh, keep = self.ops.open(nodeid, flags)
        if self.writable and is_write_handle(fh):  # reads and writes come here; close flushes
            flags = s.FOPEN_DIRECT_IO
        else:  # nothing is written, so nothing to flush: a close costs no request
            flags = s.FOPEN_NOFLUSH | (s.FOPEN_KEEP_CACHE if keep else 0)
        if not ch.send(s.OPEN_REPLY.pack(s.OPEN_REPLY.size, 0, unique, fh, flags, 0)):
            self.ops.release(fh)  # interrupted and answered: the kernel never saw fh

    def _read(self, ch: Channel, unique: int, nodeid: int, body: memoryview, uid: int) -> None:
        fh, off, size = _READ_HEAD.unpack_from(body)
        data = self.ops.read(fh, off, size, nodeid)
        with self.ops.answering(fh, nodeid):  # (the answer lands in the page cache)
            ch.reply(unique, (data,))

    def _release(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                 uid: int) -> None:
        self.ops.release(s.RELEASE_IN.unpack_from(body)[0])
        ch.reply(unique)

    def _opendir(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                 uid: int) -> None:
        s.OPEN_IN.unpack_from(body)
        fh = self.ops.opendir(nodeid)
        if not ch.send(s.OPEN_REPLY.pack(s.OPEN_REPLY.size, 0, unique, fh, 0, 0)):
            self.ops.releasedir(fh)

    def _readdir(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                 uid: int) -> None:
        self._entries(ch, unique, nodeid, body, False)

    def _readdirplus(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                     uid: int) -> None:
        self._entries(ch, unique, nodeid, body, True)

    def _entries(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                 plus: bool) -> None:
        fh, off, size = _READ_HEAD.unpack_from(body)
        out = DirReply(size, plus)
        self.ops.readdir(fh, off, out, nodeid)
        ch.reply(unique, (out.buf,))

    def _releasedir(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                    uid: int) -> None:
        self.ops.releasedir(s.RELEASE_IN.unpack_from(body)[0])
        ch.reply(unique)

    def _statfs(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                uid: int) -> None:
        ch.reply(unique, (self.ops.statfs(),))

    def _getxattr(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                  uid: int) -> None:
        size = s.GETXATTR_IN.unpack_from(body)[0]
        value = self.ops.getxattr(nodeid, _name(body[s.GETXATTR_IN.size:]), uid)
        self._sized(ch, unique, size, value)

    def _listxattr(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                   uid: int) -> None:
        size = s.GETXATTR_IN.unpack_from(body)[0]
        self._sized(ch, unique, size, b"".join(n + b"\0" for n in self.ops.listxattr(nodeid)))

    @staticmethod
    def _sized(ch: Channel, unique: int, size: int, value: bytes) -> None:
        """An xattr answer: its length when asked with size 0, ERANGE if it does
        not fit `size`, else the value."""
        if size == 0:
            ch.reply(unique, (s.GETXATTR_OUT.pack(len(value), 0),))
        elif len(value) > size:
            ch.error(unique, errno.ERANGE)
        else:
            ch.reply(unique, (value,))

    def _access(self, ch: Channel, unique: int, nodeid: int, body: memoryview,
                uid: int) -> None:
        self.ops.access(nodeid, s.ACCESS_IN.unpack_from(body)[0])
        ch.reply(unique)
