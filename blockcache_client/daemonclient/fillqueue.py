"""The fill queue of a volume's link to `blockcached` (`link.DaemonLink`),
and the filler thread that empties it.

The filler takes jobs from a queue bounded in bytes, in order, on its own
connection: `("evict", key)`, `("put", key, plaintext)` (sealed here, off
the reader's thread, and handed to `on_sealed` too: the cluster tier's
fill), `("sealed", key, block file)` (a block from the tier, as it
came) and `("area", key, slot)` (the same, landed in a slot of the fill
connection's fill area: put by reference, see `readerarea`). Keeping an
integrity eviction and its refill on one ordered queue means the daemon
sees the evict before the new put and does not discard the put as a
duplicate of the bad file.

The fill connection's fill area is opened by the filler after its first
`sealed` job (the tier is in use) or before its first `put` (a block from
the source), and anew after each reconnect; `take_slot` hands out its slots
only while it belongs to the connection open now. A daemon that refuses one
is not asked again on that connection. The filler seals a `put`'s block
straight into a free slot and puts it by reference: the daemon copies the
slot into the block file in the kernel (`sendfile`), where a block by value
cost a copy through the socket on each side and the daemon's frame buffer;
with no slot free (every one in flight: the daemon is behind) the filler
waits up to `SLOT_WAIT` for the daemon to free one, and only then sends it
by value. A block by value costs the daemon several times what one from a
slot does (the frame read on its event loop, the write from a buffer), so
sending by value as soon as the slots ran out kept a daemon that had fallen
behind on 2 busy CPUs behind for the rest of the read; the filler's wait
holds the source blocks in the fill queue instead, which is bounded in bytes.

A small fill (up to `INLINE_FILL_MAX`) offered while the queue is empty, the
filler idle and the fill connection open is sealed and sent on the reader's
thread instead, without waiting: the socket takes it or the rest is left to
the filler. Handing it to the filler cost more than sealing it: a thread
wake-up, GIL hand-offs and a wait for the reply. It is sent before the read
returns: left for the reader's next GET's wait, it measured no faster on 2
busy CPUs and reached the daemon late for other processes reading the
block (docs/reader.md, "S3 sources"). Puts are posted
(`Client.post`), never waited for one by one: their replies are read in
batches, by a put once `COLLECT_AFTER` are unread (those that have arrived),
by the filler when the link's control thread nudges it (every
`touch_interval` while some are unread), and by `wait_idle`.
Puts whose connection closed before their reply was read count as dropped.
Exactly one party uses the fill connection at a time: whoever set `_busy`
under `_fill_cv` (the filler for a job or to connect, a reader for an inline
put, `wait_idle` to read the last replies).

Invariants: `offer_fill` never blocks (a full queue drops and counts; an
inline put sends only what the socket takes at once); a job whose put fails
because the daemon went away is dropped and counted; nothing here raises into
a reader.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ..common.counters import Counters
from ..contract.errors import DaemonError, DaemonUnavailable
from .client import Client
from .readerarea import ReaderArea, Slot, slots_for

log = logging.getLogger(__name__)

CALL_TIMEOUT = 2.0
# put replies that mean the block is (or is about to be) cached already
_ALREADY_CACHED = frozenset({"exists", "duplicate"})
# fills up to this size may be sealed and sent on the reader's thread (a
# small file's block seals in less time than a thread hand-off); bigger ones
# are sealed by the filler while the reader goes on
INLINE_FILL_MAX = 256 << 10
# posted puts whose replies a put leaves unread before it reads those that
# have arrived: reading them one put at a time cost a poll and a recv per put
# on the reader's thread; 64 replies fit a few KiB of socket buffer, and the
# control thread has the rest read every interval
COLLECT_AFTER = 64
# how long the filler waits for the daemon to free a fill area slot before a
# block goes by value, looking every SLOT_POLL (the daemon frees a slot by
# writing the shared page: there is no wake-up to wait on)
SLOT_WAIT = 0.2
SLOT_POLL = 0.001


class Seal(Protocol):
    """Seals a block for the daemon (`reader.misses.fills.Sealer`)."""

    def __call__(self, key: str, plaintext: bytes | memoryview,
                 into: memoryview | None = None) -> bytes | memoryview: ...

    def file_size(self, length: int) -> int: ...


class FillQueue:
    """The fills of one volume in one process, and the filler thread that
    sends them (started by `_start_filler`; stopped by the link's close)."""

    def __init__(self, socket_path: str, counters: Counters,
                 seal: Seal, fill_queue_bytes: int,
                 daemon_up: Callable[[], bool], daemon_uid: int | None = None,
                 area_slot_bytes: int = 0):
        self.socket_path = socket_path
        # called with (key, block file bytes) after each seal: the tier's fill
        self.on_sealed: Callable[[str, memoryview], None] | None = None
        self._counters = counters
        self._seal = seal
        self._daemon_up = daemon_up  # the link is connected: fills have somewhere to go
        self._filler_client = Client(socket_path, timeout=CALL_TIMEOUT, daemon_uid=daemon_uid)
        self._closed = threading.Event()
        # fill queue: jobs in order, bounded by the plaintext bytes they hold
        self._fill_cap = max(0, int(fill_queue_bytes))
        self._fill_bytes = 0
        self._fills: collections.deque = collections.deque()
        self._queued: set[str] = set()
        self._busy = False  # someone is using the fill connection (see the module doc)
        self._tail: bytes | None = None  # an inline put's frame the socket had no room for
        fill_lock = threading.Lock()
        self._fill_cv = threading.Condition(fill_lock)  # the filler waits here for work
        self._idle_cv = threading.Condition(fill_lock)  # and wait_idle here
        self._replies_wanted = False  # the control thread asked the filler to read replies
        self._closing = False  # close() began: no new fills
        self._area_slot_bytes = area_slot_bytes  # 0: never open a fill area
        self._area: ReaderArea | None = None
        self._area_refused = 0  # the connection_id of a connection that refused one

    # -- called by readers (never block, never raise) --------------------------

    def offer_fill(self, key: str, plaintext: bytes | memoryview, sealed: bool = False,
                   done: Callable[[], None] | None = None, slot: Slot | None = None) -> bool:
        """Have a block sealed and put: now, if it is small and nothing is
        ahead of it (see the module doc), else queued. `sealed`: `plaintext`
        is already the block file's bytes (from the tier). `slot`: they are
        in that slot (`take_slot`), and go by reference if it is still the
        connection's. `done` is called once nothing here uses `plaintext` any
        more (sent or dropped), so its buffer may be reused; never before (a
        closing link may not call it). False (and counted) if dropped."""
        with self._fill_cv:
            queued = key in self._queued
            if queued or self._fill_bytes + len(plaintext) > self._fill_cap or self._closing:
                if not queued:
                    self._counters.add("fills_dropped")
                inline = None
            else:
                # connected: a reader must not wait in connect(2) for a full backlog
                inline = (not sealed and len(plaintext) <= INLINE_FILL_MAX
                          and self._daemon_up() and self._filler_client.connected
                          and not self._fills and not self._busy and self._tail is None)
                if inline:
                    self._busy = True
                else:
                    op = "area" if slot is not None else "sealed" if sealed else "put"
                    self._fills.append((op, key, slot or plaintext, done))
                    self._queued.add(key)
                    self._fill_bytes += len(plaintext)
                    self._fill_cv.notify()
                    return True
        if inline:
            try:
                self._put(key, plaintext, inline=True)
            except Exception:  # never into a reader
                log.exception("inline fill of %s failed", key)
            finally:
                self._release()
        if done is not None:
            done()
        return inline is not None or queued

    def offer_fill_waiting(self, key: str, plaintext: bytes | memoryview,
                           timeout: float) -> bool:
        """`offer_fill`, for a background thread that may wait (the cache
        fill of what a writer uploaded: many blocks at once): waits up to
        `timeout` for room in the queue, rather than drop at once."""
        with self._fill_cv:
            self._idle_cv.wait_for(lambda: self._closing or self._fill_bytes == 0 or (
                self._fill_bytes + len(plaintext) <= self._fill_cap), timeout)
        return self.offer_fill(key, plaintext)

    def take_slot(self, n: int) -> Slot | None:
        """A slot of the fill area for a sealed block of `n` bytes that will
        be offered with `offer_fill(..., slot=)`, or None (no area, every
        slot busy, or the area belongs to a closed connection)."""
        area = self._area
        if area is None or area.connection_id != self._filler_client.connection_id:
            return None
        return area.take(n)

    def evict_later(self, key: str) -> None:
        """Ask the daemon to drop a bad block, ahead of any later fill of it."""
        with self._fill_cv:
            self._fills.append(("evict", key, b"", None))
            self._fill_cv.notify()

    def pending_fill_bytes(self) -> int:
        return self._fill_bytes

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every fill offered so far is delivered and answered
        (tests, warmup, close)."""
        with self._fill_cv:
            if not self._idle_cv.wait_for(
                    lambda: not self._fills and not self._busy and self._tail is None, timeout):
                return False
            if not self._filler_client.posted:
                return True
            self._busy = True
        try:
            self._collect(wait=True)
        finally:
            self._release()
        return True


    def _start_filler(self) -> threading.Thread:
        thread = threading.Thread(target=self._filler_loop, name="blockcache-filler",
                                  daemon=True)
        thread.start()
        return thread

    # -- filler thread ---------------------------------------------------------

    def _filler_loop(self) -> None:
        while True:
            with self._fill_cv:
                while not self._closed.is_set() and (self._busy or not (
                        self._fills or self._tail is not None or self._replies_wanted)):
                    self._fill_cv.wait()
                self._replies_wanted = False
                if self._closed.is_set():
                    self._fills.clear()
                    self._queued.clear()
                    self._fill_bytes = 0
                    self._idle_cv.notify_all()
                    return
                job = self._fills.popleft() if self._fills and self._tail is None else None
                self._busy = True
            try:
                if self._tail is not None:
                    self._finish_tail()
                elif job is not None:
                    self._run_fill(*job[:3])
                else:
                    self._collect(wait=False)
            except Exception:  # never let one bad job kill the filler
                log.exception("fill job %s failed", job)
            finally:
                with self._fill_cv:
                    self._busy = False
                    if job is not None and job[0] != "evict":
                        self._queued.discard(job[1])
                        self._fill_bytes -= len(job[2])
                    self._idle_cv.notify_all()
            if job is not None and job[3] is not None:
                job[3]()  # its bytes are sent (or dropped): the owner may reuse them

    def _nudge_filler(self) -> None:
        """Have the filler read replies left unread by the last inline puts
        (so the counters catch up), at the control thread's pace rather than
        with a wake-up after every put."""
        with self._fill_cv:
            if self._filler_client.posted and not self._busy:
                self._replies_wanted = True
                self._fill_cv.notify()

    def _release(self) -> None:
        """End a reader's or `wait_idle`'s use of the fill connection: wake the
        filler only if it has work (not after every inline put)."""
        with self._fill_cv:
            self._busy = False
            if self._fills or self._tail is not None:
                self._fill_cv.notify()
            self._idle_cv.notify_all()

    def _run_fill(self, op: str, key: str, data) -> None:
        if not self._daemon_up():  # daemon down: nothing to fill into
            if op != "evict":
                self._counters.add("fills_dropped")
            if op == "put" and self.on_sealed is not None:  # the tier still takes it
                self.on_sealed(key, self._seal(key, data))
            return
        if op == "area":  # by value if a reconnect came since its area was opened
            ours = data.area is self._area and data.area.connection_id == \
                self._filler_client.connection_id
            self._put(key, data.view, inline=False, sealed=True, slot=data if ours else None)
            return
        if op == "put":
            slot = self._sealed_in_slot(key, data)
            if slot is not None:
                self._put(key, slot.view, inline=False, sealed=True, slot=slot)
                return
        if op != "evict":
            self._put(key, data, inline=False, sealed=op == "sealed")
            if op == "sealed":
                self._open_area()
            return
        try:  # posted puts' replies read meanwhile are kept for `_collect`
            self._filler_client.evict(key)
        except DaemonError as exc:  # refused (access rules, busy): the bad file stays
            log.debug("blockcached refused to evict %s: %s", key, exc)
            self._counters.add("evictions_refused")
        except DaemonUnavailable as exc:
            log.debug("evict %s not delivered: %s", key, exc)
        self._count_lost()

    def _put(self, key: str, data: bytes, inline: bool, sealed: bool = False,
             slot: Slot | None = None) -> None:
        """Seal (unless `sealed`) and post one block (the caller holds `_busy`);
        by reference if it is in `slot` of the open connection's area.
        Inline, the part of the frame the socket could not take is left to
        the filler."""
        client = self._filler_client
        if client.posted >= COLLECT_AFTER:
            self._collect(wait=False)
        try:
            if slot is not None:
                slot.area.sent(slot)
                args = {"key": key, "area": slot.index, "size": len(slot)}
            else:
                # the sealer may reuse one buffer: the blob is overwritten by
                # the next seal, so it is sent now (a tail left for later is a copy)
                blob = data if sealed else self._seal(key, data)
                if not sealed and self.on_sealed is not None:
                    self.on_sealed(key, blob)
                args = {"key": key, "data": blob}
            tail = client.post("put", args)
        except DaemonUnavailable as exc:
            log.debug("put %s not delivered: %s", key, exc)
            self._counters.add("fills_dropped")
            tail = None
        if tail is not None and inline:
            tail_copy = b"".join(tail)
            with self._fill_cv:
                self._tail = tail_copy
        elif tail is not None:
            try:
                client.finish_post(tail)
            except DaemonUnavailable as exc:
                log.debug("rest of put %s not delivered: %s", key, exc)
        self._count_lost()

    def _sealed_in_slot(self, key: str, plaintext) -> Slot | None:
        """`plaintext` sealed into a free slot of the fill area (opened first
        if this connection has none), and handed to `on_sealed`; None where
        there is no area or no free slot (the caller holds `_busy`)."""
        if not self._area_slot_bytes:
            return None
        self._open_area()
        n = self._seal.file_size(len(plaintext))
        slot = self.take_slot(n) or self._wait_for_slot(n)
        if slot is None:
            return None
        try:
            blob = self._seal(key, plaintext, slot.view)
            if self.on_sealed is not None:
                self.on_sealed(key, blob)
        except BaseException:
            slot.give()
            raise
        return slot

    def _wait_for_slot(self, n: int) -> Slot | None:
        """A slot the daemon frees within SLOT_WAIT, for a block of `n` bytes
        that fits one (the caller holds `_busy`); None without one."""
        area = self._area
        if area is None or n > area.slot_bytes:
            return None
        deadline = time.monotonic() + SLOT_WAIT
        while time.monotonic() < deadline:
            time.sleep(SLOT_POLL)
            slot = self.take_slot(n)
            if slot is not None:
                return slot
        return None

    def _open_area(self) -> None:
        """Open a fill area on the fill connection (the caller holds `_busy`),
        unless it has one or refused one. Best effort: without one, blocks
        go by value. Holds the filler for at most one CALL_TIMEOUT."""
        client = self._filler_client
        conn = client.connection_id
        slots = slots_for(self._area_slot_bytes) if self._area_slot_bytes else 0
        if not slots or not conn or conn == self._area_refused or (
                self._area is not None and self._area.connection_id == conn):
            return
        self._area = None
        self._collect(wait=True)  # the area's reply must be the next to arrive
        if client.connection_id != conn:
            # the replies did not come within the timeout (a stopped daemon):
            # asking on a new connection would hold the filler for a second one
            self._count_lost()
            return
        try:
            fd, slots, slot_bytes = client.open_area(slots, self._area_slot_bytes)
            self._area = ReaderArea(fd, slots, slot_bytes, client.connection_id)
        except (DaemonError, ValueError) as exc:
            log.info("blockcached at %s gave no fill area (%s): tier blocks go to it by value",
                     self.socket_path, exc)
            self._area_refused = conn
        except DaemonUnavailable as exc:
            log.debug("fill area not opened: %s", exc)
        self._count_lost()

    def _finish_tail(self) -> None:
        try:
            self._filler_client.finish_post(self._tail)
        except DaemonUnavailable as exc:
            log.debug("rest of a put not delivered: %s", exc)
        finally:
            with self._fill_cv:
                self._tail = None
        self._count_lost()

    def _count_lost(self) -> None:
        """Count puts whose connection closed before their reply was read."""
        lost = self._filler_client.take_lost()
        if lost:
            log.debug("%d put(s) lost with the connection to blockcached", lost)
            self._counters.add("fills_dropped", lost)

    def _collect(self, wait: bool) -> None:
        """Count the replies of posted puts that have arrived (all, with `wait`)."""
        client = self._filler_client
        if not client.posted:
            return
        replies = client.collect(wait)
        self._count_lost()
        for reply in replies:
            if not reply.get("ok"):
                log.debug("daemon refused a put: %s", reply.get("message"))
                self._counters.add("fills_dropped")
            elif reply.get("accepted"):
                self._counters.add("fills_sent")
            elif reply.get("reason") in _ALREADY_CACHED:
                pass  # another reader filled it first: nothing lost
            else:
                log.debug("daemon declined a put: %s", reply.get("reason"))
                self._counters.add("fills_dropped")
