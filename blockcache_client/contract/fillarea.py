"""Fill areas: sealed blocks handed to the daemon through shared memory.

A reader that hands the daemon whole sealed blocks it already holds (a
cluster tier hit) would otherwise send each through the socket: a copy into
the kernel, a copy out into the daemon, a wake-up per socket buffer on both
sides, before the daemon's own copy into the page cache. A fill area is a
memfd the daemon creates for one connection and passes to it (`area` op,
SCM_RIGHTS on the reply); the reader lands a block's items straight in a
slot of it and puts the block by reference (`put` with `area` = the slot and
`size`), so the daemon writes the block file from the slot: one copy in all.

Layout: a control page (one state byte per slot), then `slots` slots of
`slot_bytes` bytes each (a multiple of PAGE):

    offset                       size         what
    0                            PAGE         state[i] for slot i, one byte each
    PAGE + i * slot_bytes        slot_bytes   slot i

A slot's state says who may touch it:

- FREE: nobody uses it; the reader may take it (-> HELD);
- HELD: the reader is filling it (or gave up on it: -> FREE);
- SENT: a `put` names it: the daemon reads it, and sets FREE once it no
  longer will (written, declined or failed). The reader waits for that.

The daemon seals the memfd's size (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL)
before passing it, so no reader can shrink a slot under a copy, and copies
slots with `sendfile` (holes cost it no memory). A reader that writes a slot
it put can only spoil its own blocks, which readers authenticate anyway:
what a put by value could do.
"""

from __future__ import annotations

PAGE = 4096
FREE, HELD, SENT = 0, 1, 2
MAX_SLOTS = PAGE        # state bytes fit the control page
# the most an area may hold: the memory one connection can have the daemon create
MAX_AREA_BYTES = 64 << 20


def slot_offset(slot: int, slot_bytes: int) -> int:
    """Where slot `slot` starts in the area."""
    return PAGE + slot * slot_bytes


def area_bytes(slots: int, slot_bytes: int) -> int:
    return PAGE + slots * slot_bytes


def page_rounded(n: int) -> int:
    return -(-n // PAGE) * PAGE
