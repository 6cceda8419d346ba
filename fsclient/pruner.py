"""The node table's bound: the kernel is asked to forget nodes before the
table (and the saved state that mirrors it) outgrows the mount's `max_nodes`.

The table holds what the kernel holds (lookup counts), and only the kernel
can let go: a server that dropped a node itself would get ESTALE for an id
the kernel still sends. So once the table reaches HIGH of the cap, a thread
of its own asks the kernel to forget the least recently looked-up nodes
(`InodeTable.least_recent`: never the root, never an open file) until LOW of
it is left: FUSE_NOTIFY_PRUNE (7.45: the node ids, in batches) where the
connection speaks it, else FUSE_NOTIFY_INVAL_ENTRY on (parent, name) of
each. The kernel drops the unused dentries, evicts their inodes (FUSE keeps
no inode without a dentry) and sends FORGET, which shrinks the table and the
saved state (whose compaction then frees the dead records).

Why a thread, and the notifications through the page store's child: an
INVAL_ENTRY takes the parent directory's lock, which a lookup or readdir
waiting for this server holds. Written by a worker it could wait for the
worker's own answer; written by any thread of the server, a kill would wait
for it (an uninterruptible wait pins the process, and the answer it waits
for comes from the next server). The child (`session.storer`) waits instead,
and nothing here holds a lock the FORGET path needs while it does.

Meanwhile the table is held at the cap, not past it: a readdirplus answers
the entries past the room with node id 0 (the kernel then instantiates no
dentry and looks the name up when it is used), and a lookup that finds the
table full waits for forgets, its worker's channel handed on (`blocking`),
at most ROOM_WAIT (a round takes milliseconds, but seconds on a host whose
cores are all busy); past that, or at once when no round freed anything
of late (every node open, a cwd or mmapped), it goes on, counted in
`over_cap`.

The saved state is bounded with it: its live records are at most
`max_nodes` x SAVED_NODE_BYTES (a mean path of 99 bytes; longer paths count
as more nodes here), and compaction keeps the dead ones below the live ones
(or 1 MiB), so the memfd's log stays within `saved_cap()`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import threading
import time
from collections.abc import Callable

from .inodes import ROOT_INODE, InodeTable
from .keeper.saved import COMPACT_MIN, PAGE
from .metacache import parent_of
from .session import structs as s

log = logging.getLogger(__name__)

HIGH = 0.9  # the pruner starts at this share of the cap...
LOW = 0.75  # ...and asks the kernel to forget down to this share
ROOM_WAIT = 5.0  # a lookup that finds the table full waits this long for forgets
ROUND_WAIT = 0.2  # after a round, at most this long for the kernel's forgets
PRUNE_BATCH = 4096  # node ids per FUSE_NOTIFY_PRUNE
STUCK_ROUNDS = 3  # rounds in a row that freed nothing: the kernel will not let go
SAVED_NODE_BYTES = 128  # a saved record's mean size the cap allows (29 + the path)
FORGET_BY = "FSCLIENT_FORGET_BY"  # "inval_entry": never FUSE_NOTIFY_PRUNE


def saved_cap(max_nodes: int) -> int:
    """The most bytes the saved state's log holds with `max_nodes` nodes."""
    live = max_nodes * SAVED_NODE_BYTES
    return PAGE + max(2 * live, live + COMPACT_MIN)


class NodePruner:
    """Asks the kernel to forget nodes when the table nears `cap` (see the module)."""

    def __init__(self, nodes: InodeTable, cap: int):
        self.nodes = nodes
        self.cap = cap
        self.high = max(1, int(cap * HIGH))
        self.low = int(cap * LOW)
        # (code, body): writes a notification, OSError as the kernel answers (`attach`)
        self.notify: Callable[[int, bytes], None] | None = None
        self.minor: Callable[[], int] = int  # the connection's protocol minor
        self.blocking: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        # "inval_entry" once this kernel refused FUSE_NOTIFY_PRUNE, or when the
        # environment says so (FORGET_BY: a kernel whose prune misbehaves, the tests)
        self.via = "inval_entry" if os.environ.get(FORGET_BY) == "inval_entry" else "prune"
        self.asked = 0  # nodes the kernel was asked to forget
        self.rounds = 0
        self.over_cap = 0  # lookups that waited ROOM_WAIT and went on over the cap
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self._warned = False  # (a failure is logged once)
        # the last round freed nothing: a lookup into a full table then goes
        # on at once rather than wait for forgets that are not coming
        self._stuck = False
        self._idle_rounds = 0  # rounds in a row that freed nothing
        self._serving: Callable[[], bool] = lambda: True
        nodes.grew = self._grew

    def attach(self, notify: Callable[[int, bytes], None], minor: Callable[[], int],
               blocking: Callable[[], contextlib.AbstractContextManager],
               serving: Callable[[], bool]) -> None:
        """Ask through `notify` once `serving()` (the session's workers run:
        the child writes on their descriptor). A server that took the mount
        over may find more nodes in the saved state than its cap: it asks then."""
        self.notify, self.minor, self.blocking = notify, minor, blocking
        self._serving = serving
        if self.pressure() >= self.high:
            self._grew(0)

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    def pressure(self) -> int:
        """The table's size in nodes: those held, or the saved state's live
        bytes in SAVED_NODE_BYTES, whichever is more."""
        held = self.nodes.held()
        saved = self.nodes.saved
        if saved is not None:
            held = max(held, saved.live_bytes() // SAVED_NODE_BYTES)
        return held

    def room(self) -> int:
        """Nodes the table takes before the cap."""
        return self.cap - self.pressure()

    def wait_for_room(self) -> None:
        """Before a lookup adds a node: if the table is full, wait (the
        worker's channel handed on, so FORGETs are read) for the kernel's
        forgets, at most ROOM_WAIT."""
        if self.notify is None or self.room() > 0:
            return
        if self._stuck:  # (nothing the kernel would let go: open files, cwds)
            self.over_cap += 1
            return
        self._wake.set()
        with self.blocking():
            deadline = time.monotonic() + ROOM_WAIT
            while self.room() <= 0:
                if self._stuck or time.monotonic() >= deadline:
                    self.over_cap += 1
                    return
                time.sleep(0.005)

    def _grew(self, held: int) -> None:
        if self.notify is None or max(held, self.pressure()) < self.high:
            return
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="fuse-node-pruner")
                    self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while not self._serving():
            if self._stopped.wait(0.05):
                return
        while not self._stopped.is_set():
            self._wake.wait()
            self._wake.clear()
            try:
                self._prune()
            except Exception:
                log.exception("asking the kernel to forget nodes failed; the table may "
                              "grow past max_nodes until the next try")
                time.sleep(1.0)

    def _prune(self) -> None:
        while not self._stopped.is_set():
            before = self.pressure()
            if before < self.high:
                return
            victims = self.nodes.least_recent(before - self.low)
            if not victims:
                self._stuck = True
                return
            if not self._ask(victims):
                return
            self.rounds += 1
            # progress: victims forgotten (the table's size also counts new lookups)
            deadline = time.monotonic() + ROUND_WAIT
            while not (freed := self._freed(victims)) and time.monotonic() < deadline:
                time.sleep(0.005)
            if freed:
                self._idle_rounds = 0
            else:  # (the kernel keeps them: cwds, mmaps; others next)
                self._idle_rounds += 1
                self._stopped.wait(5 * ROUND_WAIT)
            self._stuck = self._idle_rounds >= STUCK_ROUNDS

    def _freed(self, victims: list[tuple[int, str]]) -> bool:
        """Whether the kernel has forgotten any of `victims`."""
        saved = self.nodes.saved
        return any(inode not in self.nodes and (saved is None or inode not in saved.paths)
                   for inode, _ in victims)

    def _ask(self, victims: list[tuple[int, str]]) -> bool:
        """Ask the kernel to forget `victims`; False if it cannot be asked."""
        notify, minor = self.notify, self.minor()
        if notify is None or minor == 0:  # (no INIT yet: nothing the kernel holds)
            return False
        if minor < s.PRUNE_MINOR:
            self.via = "inval_entry"
        if self.via == "prune":
            try:
                for i in range(0, len(victims), PRUNE_BATCH):
                    ids = [inode for inode, _ in victims[i:i + PRUNE_BATCH]]
                    notify(s.NOTIFY_PRUNE, s.NOTIFY_PRUNE_OUT.pack(len(ids), 0, 0)
                           + struct.pack(f"<{len(ids)}Q", *ids))
                    self.asked += len(ids)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS):
                    return self._failed(exc)
                log.info("this kernel has no FUSE_NOTIFY_PRUNE (%s); forgetting nodes by "
                         "FUSE_NOTIFY_INVAL_ENTRY", exc)
        self.via = "inval_entry"
        for _inode, path in victims:
            parent = parent_of(path)
            parent_id = self.nodes.inode_of(parent) if parent else ROOT_INODE
            name = os.fsencode(path.rpartition("/")[2])
            try:
                notify(s.NOTIFY_INVAL_ENTRY,
                       s.NOTIFY_INVAL_ENTRY_OUT.pack(parent_id, len(name), 0) + name + b"\0")
                self.asked += 1
            except OSError as exc:
                if exc.errno != errno.ENOENT:  # (ENOENT: the kernel has no such entry)
                    return self._failed(exc)
        return True

    def _failed(self, exc: OSError) -> bool:
        if not self._warned:
            self._warned = True
            log.warning("cannot ask the kernel to forget nodes (%s); the node table may "
                        "grow past max_nodes", exc)
        if exc.errno == errno.EPIPE:  # (the child has gone: the server is ending)
            self.notify = None
        return False
