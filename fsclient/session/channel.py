"""A channel: one file descriptor of a FUSE connection that requests are read from
and answered on.

The mount's own /dev/fuse descriptor is the first channel; `clone` opens another
/dev/fuse and attaches it to the same connection (FUSE_DEV_IOC_CLONE), so each
worker thread reads and answers on its own descriptor. The kernel hands each
request to one reader; its answer may go to any channel of the connection, but
each worker answers on the channel it read from.

Every read is one whole request into a buffer made once per channel (`readinto`);
every answer is one `writev` of the header and its parts, or one `write` of a
reply packed whole (an error, an empty reply, an open's). Any descriptor that keeps
message boundaries serves (a SOCK_SEQPACKET socket in the protocol tests).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Sequence

from . import structs as s

# Errors that end reading: the connection is gone (unmounted or aborted).
GONE = frozenset({errno.ENODEV, errno.ECONNABORTED, errno.EBADF})
# Errors of a read that just tries again: a signal, a request taken by another
# reader between the wake-up and the read, a request interrupted while queued.
AGAIN = frozenset({errno.EINTR, errno.EAGAIN, errno.ENOENT})


# read(2) straight from libc, GIL released: unlike os.readv it returns EINTR to
# the caller instead of retrying, so a signal can stop a reader (`read_or_wake`).
_libc = ctypes.CDLL(None, use_errno=True)
_read = _libc.read
_read.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_read.restype = ctypes.c_ssize_t


def open_device() -> int:
    """A new /dev/fuse descriptor (close-on-exec)."""
    return os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)


class Channel:
    """One descriptor of the connection and the request buffer read into."""

    __slots__ = ("fd", "buf", "view", "owned", "_cbuf", "_address")

    def __init__(self, fd: int, buffer_size: int, owned: bool = True):
        self.fd = fd
        self.buf = bytearray(buffer_size)
        self.view = memoryview(self.buf)
        self.owned = owned  # closed with the channel (the mount's own fd is not)
        self._cbuf = None  # `buf` as ctypes sees it (held: `buf` never resizes then)
        self._address = 0  # and its address, for `read_or_wake`

    @classmethod
    def clone(cls, fd: int, buffer_size: int) -> Channel:
        """A new /dev/fuse descriptor attached to `fd`'s connection."""
        new = open_device()
        try:
            fcntl.ioctl(new, s.DEV_IOC_CLONE, struct.pack("I", fd))
        except OSError:
            os.close(new)
            raise
        return cls(new, buffer_size)

    def read(self) -> int:
        """Read one request into `buf`; its length, or 0 when the connection is gone.
        Raises OSError only for errors other than GONE and AGAIN."""
        while True:
            try:
                return os.readv(self.fd, (self.buf,))
            except OSError as exc:
                if exc.errno in AGAIN:
                    continue
                if exc.errno in GONE:
                    return 0
                raise

    def read_or_wake(self) -> int:
        """`read`, but -1 when a signal interrupts the wait (the caller looks at
        why it was woken): a thread stopped so has read nothing."""
        if self._cbuf is None:
            self._cbuf = (ctypes.c_char * len(self.buf)).from_buffer(self.buf)
            self._address = ctypes.addressof(self._cbuf)
        while True:
            n = _read(self.fd, self._address, len(self.buf))
            if n >= 0:
                return n
            code = ctypes.get_errno()
            if code == errno.EINTR:
                return -1
            if code in AGAIN:
                continue
            if code in GONE:
                return 0
            raise OSError(code, os.strerror(code))

    def reply(self, unique: int, parts: Sequence[bytes | memoryview | bytearray] = ()) -> bool:
        """Answer request `unique` with the concatenation of `parts`. False if the
        kernel no longer waits for it (interrupted and answered, or the
        connection gone): nothing to do then."""
        if not parts:
            return self.send(s.OUT_HEADER.pack(s.OUT_HEADER.size, 0, unique))
        size = s.OUT_HEADER.size
        for p in parts:
            size += len(p)
        return self._write([s.OUT_HEADER.pack(size, 0, unique), *parts])

    def send(self, message: bytes) -> bool:
        """Write one whole answer, its header packed in (a fixed-size reply
        packed at once: one buffer, one `write`); False as `reply`."""
        try:
            os.write(self.fd, message)
        except OSError as exc:
            return self._lost(exc)
        return True

    def error(self, unique: int, code: int) -> bool:
        """Answer request `unique` with -errno `code`."""
        return self.send(s.OUT_HEADER.pack(s.OUT_HEADER.size, -code, unique))

    def notify_store(self, nodeid: int, offset: int, data: bytes | memoryview) -> None:
        """Put `data` into the kernel's page cache of `nodeid` at `offset`
        (FUSE_NOTIFY_STORE). Raises OSError as the kernel answers it."""
        head = s.NOTIFY_STORE_OUT.pack(nodeid, offset, len(data), 0)
        total = s.OUT_HEADER.size + len(head) + len(data)
        os.writev(self.fd, [s.OUT_HEADER.pack(total, s.NOTIFY_STORE, 0), head, data])

    def notify_inval_attrs(self, nodeid: int) -> None:
        """Have the kernel drop the attributes it holds for `nodeid`
        (FUSE_NOTIFY_INVAL_INODE with a negative offset: no page is touched,
        so no page lock is taken and a worker may write it). Raises OSError
        as the kernel answers it (ENOENT: it holds no such node)."""
        body = s.NOTIFY_INVAL_INODE_OUT.pack(nodeid, -1, 0)
        os.write(self.fd, s.OUT_HEADER.pack(s.OUT_HEADER.size + len(body),
                                             s.NOTIFY_INVAL_INODE, 0) + body)

    def notify_resend(self) -> None:
        """Ask the kernel to queue again every request read but not answered on
        this connection (FUSE_NOTIFY_RESEND, 7.40): a bare header, unique 0.
        Raises OSError as the kernel answers it (EINVAL before 7.40)."""
        os.write(self.fd, s.OUT_HEADER.pack(s.OUT_HEADER.size, s.NOTIFY_RESEND, 0))

    def _write(self, parts: list) -> bool:
        try:
            os.writev(self.fd, parts)
        except OSError as exc:
            return self._lost(exc)
        return True

    @staticmethod
    def _lost(exc: OSError) -> bool:
        """False for an answer no one waits for (ENOENT: the request was
        interrupted and answered; or the connection is gone); raises the rest."""
        if exc.errno == errno.ENOENT or exc.errno in GONE:
            return False
        raise exc

    def close(self) -> None:
        if self.owned and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1
