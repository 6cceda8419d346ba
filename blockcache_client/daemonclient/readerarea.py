"""A reader's side of its fill area (contract/fillarea.py): the mapping of
the memfd the daemon passed, and its slots' states.

The reading thread takes a slot (FREE -> HELD) for a block it will hand to
the daemon, lands the block's tier items in it, and either gives it back
(HELD -> FREE: the block was bad, or went by value) or has the link put it by
reference (HELD -> SENT); the daemon sets SENT -> FREE once it has written
the block (or declined it). A slot is never reused while SENT, so the
daemon never reads a slot being refilled.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading

from ..contract import fillarea
from ..contract.fillarea import FREE, HELD, SENT

# most slots a reader asks for: blocks in flight to a daemon slower than the
# tier (only slots in use are ever touched: `take` is first-fit)
MAX_AREA_SLOTS = 16
_FREE = bytes([FREE])


def slots_for(slot_bytes: int) -> int:
    """How many slots of `slot_bytes` to ask for: up to MAX_AREA_SLOTS, as
    many as the largest area holds; 0 if not even one does."""
    rounded = fillarea.page_rounded(max(1, slot_bytes))
    return min(MAX_AREA_SLOTS, (fillarea.MAX_AREA_BYTES - fillarea.PAGE) // rounded)


class Slot:
    """One taken slot: `view` holds the block's bytes (exactly as many as asked)."""

    __slots__ = ("area", "index", "view")

    def __init__(self, area: ReaderArea, index: int, view: memoryview):
        self.area = area
        self.index = index
        self.view = view

    def __len__(self) -> int:
        return len(self.view)

    def give(self) -> None:
        """Not put by reference after all: free it. A SENT slot is the daemon's to free."""
        self.area.give(self)


class ReaderArea:
    """The mapping of one connection's fill area (thread-safe)."""

    def __init__(self, fd: int, slots: int, slot_bytes: int, connection_id: int):
        """Maps `fd` (closed here, whatever happens): ValueError if it is not
        the sealed area of the size the daemon named."""
        try:
            size = fillarea.area_bytes(slots, slot_bytes)
            if not 1 <= slots <= fillarea.MAX_SLOTS or slot_bytes % fillarea.PAGE:
                raise ValueError(f"a fill area of {slots} slots of {slot_bytes} bytes")
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK or os.fstat(fd).st_size < size:
                raise ValueError("a fill area that could shrink, or is smaller than named")
            self._mm = mmap.mmap(fd, size)
            self._map = memoryview(self._mm)
        except OSError as exc:  # F_GET_SEALS on something else than a memfd
            raise ValueError(f"not a fill area: {exc}") from None
        finally:
            os.close(fd)
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.connection_id = connection_id  # of the connection it was opened on
        self._lock = threading.Lock()

    def take(self, n: int) -> Slot | None:
        """A FREE slot, now HELD, viewing its first `n` bytes; None if every
        slot is in use or `n` does not fit one."""
        if n > self.slot_bytes:
            return None
        with self._lock:
            # the first free one: slots the daemon keeps up with stay the
            # only ones touched (a slot's first use faults in its pages)
            i = self._mm.find(_FREE, 0, self.slots)
            if i < 0:
                return None
            self._mm[i] = HELD
        start = fillarea.slot_offset(i, self.slot_bytes)
        return Slot(self, i, self._map[start:start + n])

    def give(self, slot: Slot) -> None:
        with self._lock:
            if self._mm[slot.index] == HELD:
                self._mm[slot.index] = FREE

    def sent(self, slot: Slot) -> None:
        """A put names the slot: it is the daemon's until it sets it FREE."""
        self._mm[slot.index] = SENT
