"""The daemon's side of a fill area (`contract/fillarea.py`): one per
connection that asks, created here, sealed, and passed to the peer.

The daemon never maps the slots: a put's block is copied from its slot into
the block file by `sendfile` (`AreaSpan.write_to`), in the kernel. Reading
through a mapping would fault in a page for every hole a reader left in a
slot, charged to the daemon and kept in the memfd while the connection
lives: up to a whole area per connection. `sendfile` reads holes as zeros
and allocates nothing. Only the control page is mapped, to set states.

Invariants:
- the memfd's size is sealed before the peer gets it: a slot's bytes are
  always there to copy (no short copy from a shrunk file);
- a slot named by a put is read only through its `AreaSpan`, and `release`
  sets it FREE once nothing here reads it (the put's write finished, or was
  never queued): until then the reader leaves it alone;
- the memfd stays open while the area or any span of it lives (a write
  queued by a connection that has closed still reads its slot), and is
  closed when the last of them goes;
- what reaches a block path is what was validated (DESIGN.md, invariant 1):
  the put's header is checked from the slot on the loop, but the reader
  could rewrite the slot before or while the worker copies it. So
  `write_to` checks the copy, in the tmp file before its rename: its header
  must be the one validated and its length the one declared, and the slot
  must still hold that header once the copy is done (a rewrite finished
  meanwhile shows there). Else `SlotRewritten`: the tmp file is removed and
  the put dropped (counted, not a disk error). Chunks rewritten under an
  unchanged header can still land mixed: a reader can put bad chunks by
  value too, and readers authenticate every chunk.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import socket
import weakref

from blockcache_client.contract import fillarea
from blockcache_client.contract.blockfile import HEADER_SIZE
from blockcache_client.contract.errors import ProtocolError
from blockcache_client.contract.protocol import ErrorCode

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def pass_area(transport, area: DaemonArea, frame: bytes) -> int:
    """Send `frame` (the reply to `area`) with the area's memfd attached;
    the bytes of it sent (the caller writes the rest). The transport cannot
    carry a descriptor, so it goes by sendmsg on the socket itself: only
    when nothing is waiting in the transport's buffer, so the reply keeps
    its place in the stream. OSError if it cannot."""
    if transport.get_write_buffer_size():
        raise BlockingIOError("replies are waiting to be sent")
    sock = transport.get_extra_info("socket").dup()
    try:
        sent = socket.send_fds(sock, [frame], [area.fd])
    finally:
        sock.close()
    area.passed = True
    return sent


class SlotRewritten(Exception):
    """A slot changed between its put's checks and the end of its copy."""


class DaemonArea:
    """A sealed memfd of `slots` slots of `slot_bytes`; `passed` once its
    descriptor went to the peer."""

    def __init__(self, slots: int, slot_bytes: int):
        if not 1 <= slots <= fillarea.MAX_SLOTS or slot_bytes < 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"a fill area has 1..{fillarea.MAX_SLOTS} slots of at least "
                                f"1 byte; asked for {slots} of {slot_bytes}")
        slot_bytes = fillarea.page_rounded(slot_bytes)
        size = fillarea.area_bytes(slots, slot_bytes)
        if size > fillarea.MAX_AREA_BYTES:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"a fill area of {slots} slots of {slot_bytes} bytes would map "
                                f"{size} bytes; at most {fillarea.MAX_AREA_BYTES} are allowed: "
                                f"ask for fewer or smaller slots")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.passed = False
        self.fd = os.memfd_create("blockcache-fill-area", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, size)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        self._states = mmap.mmap(self.fd, fillarea.PAGE)

    def span(self, slot: int, size: int) -> AreaSpan:
        """The first `size` bytes of `slot`; BAD_REQUEST naming what is wrong."""
        if not 0 <= slot < self.slots:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"fill area slot {slot} does not exist: the area has "
                                f"{self.slots}")
        if not 0 < size <= self.slot_bytes:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"a put of {size} bytes from fill area slot {slot}: a slot "
                                f"holds 1..{self.slot_bytes}")
        return AreaSpan(self, slot, size)

    def release(self, slot: int) -> None:
        """Slot `slot` is not read here any more: the reader may reuse it."""
        self._states[slot] = fillarea.FREE


class AreaSpan:
    """A block in a slot: what `Store.write` copies into its file, and who
    frees the slot once nothing reads it (`release`)."""

    __slots__ = ("area", "slot", "offset", "size", "checked")

    def __init__(self, area: DaemonArea, slot: int, size: int):
        self.area = area  # keeps the memfd open until the write is done
        self.slot = slot
        self.offset = fillarea.slot_offset(slot, area.slot_bytes)
        self.size = size
        self.checked = b""  # the header as `head` gave it for validation

    def __len__(self) -> int:
        return self.size

    def head(self, n: int) -> bytes:
        """Its first `n` bytes (a copy: the reader may change the slot);
        the header validated from them is what `write_to` holds the copy to."""
        self.checked = os.pread(self.area.fd, min(n, self.size), self.offset)
        return self.checked

    def write_to(self, fd: int, preallocate: bool = True) -> bool:
        """Copy it to `fd` (a new, readable file), in the kernel, after
        reserving its blocks (`preallocate`); then SlotRewritten unless the
        copy has the header validated (`head`) and the length declared, and
        the slot still has that header. Returns False if the file system
        cannot preallocate (not worth asking again)."""
        if preallocate:
            preallocate = _preallocate(fd, self.size)
        done = 0
        while done < self.size:
            n = os.sendfile(fd, self.area.fd, self.offset + done, self.size - done)
            if n == 0:  # cannot happen to a sealed area: never loop on it
                raise OSError(f"fill area ended {self.size - done} bytes short")
            done += n
        n = min(HEADER_SIZE, self.size)
        if not self.checked or os.fstat(fd).st_size != self.size \
                or os.pread(fd, n, 0) != self.checked[:n] \
                or os.pread(self.area.fd, n, self.offset) != self.checked[:n]:
            raise SlotRewritten(f"fill area slot {self.slot} changed while it was copied")
        return preallocate

    def release(self) -> None:
        """Nothing here reads the slot any more: the reader may reuse it."""
        self.area.release(self.slot)


def _preallocate(fd: int, size: int) -> bool:
    """Reserve `size` bytes of blocks for `fd`, its size unchanged (so a
    short copy still shows): ext4 then maps each page-cache folio of the
    copy to that extent instead of reserving delayed allocation per folio
    (DESIGN.md, "What a put costs"). False where the file system cannot."""
    if _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, size) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, os.strerror(err))
