"""The daemon's side of a fill area (`contract/fillarea.py`): one per
connection that asks, created here, sealed, mapped, and passed to the peer.

Invariants:
- the memfd's size is sealed before the peer gets it: reads of the mapping
  never fault past its end;
- a slot named by a put is read only through `view`, and `release` sets it
  FREE once nothing here reads it (the put's write finished, or was never
  queued): until then the reader leaves it alone;
- the mapping lives as long as a view of it does (a write queued by a
  connection that has closed still reads its slot): nothing unmaps it
  while it is in use.
"""

from __future__ import annotations

import fcntl
import mmap
import os

from blockcache_client.contract import fillarea
from blockcache_client.contract.errors import ProtocolError
from blockcache_client.contract.protocol import ErrorCode

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class FillArea:
    """A sealed memfd of `slots` slots of `slot_bytes`, mapped here."""

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
        self.fd = os.memfd_create("blockcache-fill-area", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = memoryview(mmap.mmap(self.fd, size))
        except BaseException:
            os.close(self.fd)
            raise

    def close_fd(self) -> None:
        """The peer has its copy (or will never get one): ours is not needed."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def view(self, slot: int, size: int) -> memoryview:
        """The first `size` bytes of `slot`; BAD_REQUEST naming what is wrong."""
        if not 0 <= slot < self.slots:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"fill area slot {slot} does not exist: the area has "
                                f"{self.slots}")
        if not 0 < size <= self.slot_bytes:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"a put of {size} bytes from fill area slot {slot}: a slot "
                                f"holds 1..{self.slot_bytes}")
        start = fillarea.slot_offset(slot, self.slot_bytes)
        return self._map[start:start + size]

    def release(self, slot: int) -> None:
        """Slot `slot` is not read here any more: the reader may reuse it."""
        self._map[slot] = fillarea.FREE
