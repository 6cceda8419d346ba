"""Block files kept open for the files a caller holds open (`VolumeFile`).

Why: a small random read of a cached block otherwise opens and closes its
block file every time, which costs more than serving the bytes from the
chunk cache (`chunks`). A handle's partial reads keep the block file open:
in an LRU of at most `OPEN_LIMIT` descriptors per process and volume (and
no more than `NOFILE_SHARE` of the process's open-files limit), closed when
the last handle that used it closes or when the bound pushes it out. The
bound must cover the blocks an epoch of random reads touches: a block whose
file was pushed out is opened again on the next read, which costs several
times the hit itself.

Revalidated at every use: the daemon puts a block file in place by rename
and evicts it by unlink, so a held file whose link count is 0 was evicted or
replaced; it is closed and the path opened again. The descriptor pins its
inode, so what it reads is the file whose header was read at open.

A read borrows an entry for its duration; a close (the bound, the handle,
a revalidation) while it is borrowed happens when it is given back, so a
descriptor number is never closed under a pread and reused by another open.
"""

from __future__ import annotations

import os
import resource
import threading
from collections import OrderedDict
from typing import Protocol

OPEN_LIMIT = 1024  # block files kept open per process and volume
NOFILE_SHARE = 4   # at most 1/NOFILE_SHARE of the soft RLIMIT_NOFILE: the rest is the caller's


def default_limit() -> int:
    """`OPEN_LIMIT`, within this process's share of its open-files limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return OPEN_LIMIT
    return min(OPEN_LIMIT, soft // NOFILE_SHARE)


class OpenBlock:
    """One block file held open: its descriptor, header bytes and size."""

    __slots__ = ("key", "fd", "head", "size", "users", "owners", "doomed", "closed",
                 "touched")

    def __init__(self, key: str, fd: int, head: bytes, size: int) -> None:
        self.key = key
        self.fd = fd
        self.head = head
        self.size = size
        self.users = 0      # reads borrowing it now
        self.owners = 0     # handles that used it and are still open
        self.doomed = False  # out of the table: closed once no read uses it
        self.closed = False
        self.touched = -1   # the `DaemonLink.touch_round` its last hit was reported in


class Holder(Protocol):
    """An open handle's side of the table (`handlehits.HandleBlocks`): what
    the hit path tells it about the block files it reads."""

    keys: set[str]  # the block files the table keeps open for it (`borrow`'s `owner`)

    def remember(self, key: str, ent: OpenBlock) -> None:
        """A chunked read of `key` succeeded with the open file `ent`."""

    def forget(self, key: str) -> None:
        """`key`'s file turned out stale or bad."""

    def hold_bound(self, key: str, head: bytes) -> None:
        """The handle read `key`'s block from memory, sealed here with `head`."""


class BlockFiles:
    """The bounded table of open block files of one volume in one process."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = max(0, default_limit() if limit is None else limit)
        self._lock = threading.Lock()
        self._open: OrderedDict[str, OpenBlock] = OrderedDict()

    @classmethod
    def renew(cls, old: BlockFiles | None) -> BlockFiles:
        """A new table for this process; the inherited one's files closed."""
        if old is not None:
            old.close_all()
        return cls()

    def __len__(self) -> int:
        return len(self._open)

    def borrow(self, key: str, owner: set[str]) -> OpenBlock | None:
        """The open file of `key`, still linked, borrowed until `give_back`;
        None if none is held. `owner` is the handle's set of keys: this
        handle now keeps the file open until it closes (`disown`)."""
        with self._lock:
            ent = self._open.get(key)
            if ent is None:
                return None
            self._open.move_to_end(key)
            ent.users += 1
            if key not in owner:
                owner.add(key)
                ent.owners += 1
        try:
            linked = os.fstat(ent.fd).st_nlink > 0
        except OSError:
            linked = False
        if linked:
            return ent
        self.give_back(ent, drop=True)
        return None

    def adopt(self, key: str, fd: int, head: bytes, size: int, owner: set[str]) -> OpenBlock:
        """Keep `fd` (now the table's to close) open for the handle `owner`;
        returned borrowed, as `borrow` does."""
        ent = OpenBlock(key, fd, head, size)
        ent.users = ent.owners = 1
        owner.add(key)
        victims = []
        with self._lock:
            old = self._open.get(key)
            if old is not None:
                self._doom(old, victims)
            self._open[key] = ent
            while len(self._open) > self.limit:
                self._doom(next(iter(self._open.values())), victims)
        _close_all(victims)
        return ent

    def give_back(self, ent: OpenBlock, drop: bool = False) -> None:
        """End a borrow; `drop`: the file is stale or bad, close it."""
        victims: list[OpenBlock] = []
        with self._lock:
            ent.users -= 1
            if drop:
                self._doom(ent, victims)
            elif ent.doomed and ent.users == 0 and not ent.closed:
                ent.closed = True
                victims.append(ent)
        _close_all(victims)

    def disown(self, owner: set[str]) -> None:
        """A handle closed: close the files no other open handle uses."""
        victims: list[OpenBlock] = []
        with self._lock:
            for key in owner:
                ent = self._open.get(key)
                if ent is not None:
                    ent.owners -= 1
                    if ent.owners <= 0:
                        self._doom(ent, victims)
            owner.clear()
        _close_all(victims)

    def close_all(self) -> None:
        """Close every file (the volume closed, or this is a forked child)."""
        victims: list[OpenBlock] = []
        with self._lock:
            for ent in list(self._open.values()):
                self._doom(ent, victims)
        _close_all(victims)

    def _doom(self, ent: OpenBlock, victims: list[OpenBlock]) -> None:
        """Take `ent` out of the table (the lock is held); it goes to
        `victims` to be closed if no read borrows it."""
        if self._open.get(ent.key) is ent:
            del self._open[ent.key]
        ent.doomed = True
        if ent.users == 0 and not ent.closed:
            ent.closed = True
            victims.append(ent)


def _close_all(victims: list[OpenBlock]) -> None:
    for ent in victims:
        try:
            os.close(ent.fd)
        except OSError:
            pass
