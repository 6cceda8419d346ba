"""The session: worker threads, each reading requests from its own channel and
answering each one on the thread that read it.

A hit is read and decrypted on the worker that took its request: no hand-off, no
event loop. The workers are few (the mount's `threads`, one by default): Python
runs on one core at a time whatever the threads, and each worker beyond one
only takes turns at the GIL, each turn a context switch. A handler about to
wait (a remote request, a disk read, a listing) calls `blocking()`: its thread
hands its channel to a new thread and goes on with that one request alone, then
ends; so a remote miss never holds a worker, and hits go on being answered
meanwhile. At most MAX_WAITING requests wait that way at once; past that a wait
holds its worker, as it would with no hand-off. Every worker but the first
reads a clone of the mount's descriptor (FUSE_DEV_IOC_CLONE), so the kernel
wakes one reader per request.

Counted per worker (no shared counter on the request path), summed when read:
requests per opcode, and whether the worker is busy now (a request handed off
with its thread counts as busy until it is answered).

Interrupts: the kernel asks to interrupt a request it is waiting for (a reader got
a signal). A handler on a thread cannot be stopped, so the interrupted request is
answered EINTR at once, which ends the reader's wait; the handler's own
late answer then finds the request gone and is dropped (an OPEN's handle is
released, the kernel never having seen it). The kernel interrupts only requests
it has handed to a reader, but another worker may not have registered its request
yet: an INTERRUPT whose request is not found is answered EAGAIN, and the kernel
sends it again while the request still waits (for one already answered it drops
the EAGAIN).

Kernels before 7.40 cannot resend (`Negotiated.resends`): a request a server read
and left unanswered waits until the connection ends. There a server that stops
answers everything it read first (`drain`): its readers are woken out of their
reads by WAKE_SIGNAL (a thread stopped so has read nothing), a request already
read is answered, and only then does the server go. What a killed server had
read, the next one answers EINTR before anything else (`stranded`); and an
INTERRUPT whose request no worker holds is tried on every channel before EAGAIN,
for one older than that sweep: a signal to its reader then ends its wait.

What must hold:
- Nothing but INIT is served before INIT is answered (EIO, as libfuse does).
- A request too short for its header is dropped (answered EIO when its unique can
  be read); one whose length field disagrees with what was read is answered EIO;
  neither ends the session.
- The session ends when the connection does (unmount: reads return ENODEV), on
  DESTROY, or on `stop`.
- Each channel has one reader thread at a time: a thread that handed its channel
  on never reads it again. Channels are closed only when no handed-off request
  is still to be answered on them (a closed number could be reused by any file).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import structs as s
from .channel import Channel
from .negotiate import FORCED_MINOR, Negotiated, ProtocolError, forced_minor, max_write, negotiate
from .requests import Dispatcher, Operations
from .stranded import sweep

log = logging.getLogger(__name__)

_OPCODES = 64  # per-opcode counters; larger opcodes count under 0
# Requests waiting (a remote fetch, a listing) on threads of their own at once,
# at most; past that a wait holds its worker.
MAX_WAITING = 64
# Sent to a worker thread blocked in its read to stop it (`drain`, before 7.40);
# its handler does nothing: the read returns EINTR, having taken no request.
WAKE_SIGNAL = signal.SIGRTMIN + 2


class Worker:
    """One thread's channel and its counters."""

    __slots__ = ("channel", "thread", "ops", "busy", "reading")

    def __init__(self, channel: Channel):
        self.channel = channel
        self.thread: threading.Thread | None = None
        self.ops = [0] * _OPCODES
        self.busy = False
        self.reading = False  # in a read that WAKE_SIGNAL ends


class Session:
    """One FUSE connection served by `workers` threads."""

    def __init__(self, ops: Operations, workers: int, clone: bool = True,
                 terms: Negotiated | None = None, writable: bool = False):
        self.ops = ops
        self.fd = -1
        self.nworkers = max(1, workers)
        self.clone = clone
        self.writable = writable  # writes are served (else answered EROFS)
        self.dispatcher = Dispatcher(ops, writable)
        # set once INIT is answered (or given: a session taken over)
        self.terms = terms
        self.buffer_size = (terms or _default_terms(writable)).buffer_size()
        self.workers: list[Worker] = []
        self.ended = threading.Event()  # DESTROY, stop, or every worker gone
        self.latency: Any = None  # a LockedHistogram of handling time per op, when timed
        # called with the terms once INIT is agreed, before the kernel hears of it
        # (the keeper's saved state keeps them for a successor)
        self.on_init: Callable[[Negotiated], None] | None = None
        self._inflight: dict[int, Channel] = {}  # unique -> channel, for INTERRUPT
        self._running = 0  # threads reading a channel, or answering a request handed off
        self._waiting = 0  # requests handed off with their thread (`blocking`), not answered
        self.handoffs = 0  # requests handed off so far
        self.read_draining = 0  # requests read while draining (answered before 7.40)
        self._local = threading.local()  # .worker: the Worker whose channel this thread reads
        self._draining = False  # handing over: a request read now is left to the successor
        # (or answered, before 7.40); the reads are wakeable until the terms say
        # the kernel resends, and with them, a drain stops the readers
        self._wakeable = terms is None or not terms.resends
        self._sweeping = False  # a takeover with no resend: the first request sweeps
        self._lock = threading.Lock()

    # lifecycle

    def start(self, fd: int, channel_fds: Sequence[int] = (), taken_over: bool = False) -> None:
        """Start the workers: the first on the mount's descriptor `fd` (which the
        caller keeps and closes), the rest on `channel_fds` (the keeper's clones,
        also kept by the caller) and then on clones made here. `taken_over`: a
        server served this connection before; with no resend (before 7.40) the
        first worker answers what it left (`stranded`), then starts the others."""
        self.fd = fd
        if threading.current_thread() is threading.main_thread():
            signal.signal(WAKE_SIGNAL, _woken)  # (a handler only the main thread can set)
        channels = [Channel(self.fd, self.buffer_size, owned=False)]
        channels += [Channel(c, self.buffer_size, owned=False)
                     for c in channel_fds[:self.nworkers - 1]]
        for _ in range(self.nworkers - len(channels)):
            if self.clone:
                try:
                    channels.append(Channel.clone(self.fd, self.buffer_size))
                    continue
                except OSError as exc:
                    log.warning("cannot clone the FUSE channel (%s); workers share one", exc)
                    self.clone = False
            channels.append(Channel(self.fd, self.buffer_size, owned=False))
        for i, ch in enumerate(channels):
            w = Worker(ch)
            w.thread = threading.Thread(target=self._run, args=(w,), daemon=True,
                                        name=f"fuse-worker-{i}")
            self.workers.append(w)
        self._sweeping = taken_over and self.terms is not None and not self.terms.resends
        self._running = 1 if self._sweeping else len(self.workers)
        for w in self.workers[:1] if self._sweeping else self.workers:
            w.thread.start()  # type: ignore[union-attr]

    def _sweep(self, first: int) -> None:
        """Answer what a killed server left (`stranded.sweep`), then start the
        workers held back (none of them has read a request below `first`)."""
        self._sweeping = False
        took = time.monotonic()
        answered = sweep((w.channel for w in self.workers), first)
        took = time.monotonic() - took
        if answered:
            log.warning("answered EINTR %d requests a server before this one read and "
                        "left (no resend before FUSE 7.40; swept below %d in %.2fs)",
                        answered, first, took)
        else:
            log.info("no request left by the server before (swept below %d in %.2fs)",
                     first, took)
        with self._lock:
            self._running += len(self.workers) - 1
        for w in self.workers[1:]:
            w.thread.start()  # type: ignore[union-attr]

    def stop(self) -> None:
        """Ask the workers to end after their current request."""
        self.ended.set()

    def join(self, timeout: float) -> bool:
        """Wait for the workers to end; True if all did."""
        deadline = time.monotonic() + timeout
        for w in self.workers:
            if w.thread is not None:
                w.thread.join(max(0.0, deadline - time.monotonic()))
        return not any(w.thread is not None and w.thread.is_alive() for w in self.workers)

    def close(self) -> None:
        """Close the cloned channels of workers that have ended (none while a
        request handed off may still be answered on one)."""
        if self._waiting:
            return  # left to the process's exit
        for w in self.workers:
            if w.thread is None or not w.thread.is_alive():
                w.channel.close()

    def resend(self) -> bool:
        """Ask the kernel for the requests a dead predecessor had read (a session
        taken over); False if this kernel cannot (before 7.40, or refused)."""
        if self.terms is not None and self.terms.minor < s.RESEND_MINOR:
            return False
        try:
            self.workers[0].channel.notify_resend()
        except OSError as exc:
            log.warning("the kernel refused FUSE_NOTIFY_RESEND (%s): requests the previous "
                        "server had read wait until interrupted", exc)
            return False
        return True

    def drain(self, timeout: float) -> bool:
        """Stop taking requests and wait for those being handled; True if all
        were answered. From 7.40 workers blocked in a read stay there: a
        request one of them takes now is left unanswered, for the successor's
        resend. Before 7.40 (`answers_all`) every reader is stopped and what
        it read answered; what a handler still holds at `timeout` is answered
        EINTR (the reader's syscall fails EINTR, which Python retries, and the
        retry goes to the successor), as nothing would ever answer it."""
        self._draining = True
        self.ended.set()
        deadline = time.monotonic() + timeout
        if not self.answers_all():
            while self.busy() and time.monotonic() < deadline:
                time.sleep(0.005)
            return not self.busy()
        while not self._stopped() and time.monotonic() < deadline:
            self._wake_readers()
            time.sleep(0.005)
        if self._stopped():
            return True
        left = dict(self._inflight)
        for unique, ch in left.items():
            ch.error(unique, errno.EINTR)
        log.warning("%d requests still handled after %gs of draining answered EINTR (no "
                    "resend before FUSE 7.40)", len(left), timeout)
        return False

    def answers_all(self) -> bool:
        """A server that stops must answer what it read: the kernel cannot
        resend it (before 7.40), and WAKE_SIGNAL can stop the readers."""
        return self.terms is not None and not self.terms.resends and \
            signal.getsignal(WAKE_SIGNAL) is _woken

    def _stopped(self) -> bool:
        """No thread reads a channel or handles a request."""
        return self._waiting == 0 and not any(
            w.thread is not None and w.thread.is_alive() for w in self.workers)

    def _wake_readers(self) -> None:
        for w in self.workers:
            t = w.thread
            if w.reading and t is not None and t.ident is not None and t.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    signal.pthread_kill(t.ident, WAKE_SIGNAL)

    def notify_store(self, nodeid: int, offset: int, data: bytes | memoryview) -> None:
        """Put file data into the kernel's page cache (see `Channel.notify_store`)."""
        self.workers[0].channel.notify_store(nodeid, offset, data)

    def notify_inval_attrs(self, nodeid: int) -> None:
        """Drop the kernel's attributes of a node (see `Channel.notify_inval_attrs`)."""
        self.workers[0].channel.notify_inval_attrs(nodeid)

    def notify_fd(self) -> int:
        """A descriptor of the connection to write notifications on."""
        return self.workers[0].channel.fd

    # what the metrics read

    def busy(self) -> int:
        return sum(1 for w in self.workers if w.busy) + self._waiting

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Around a wait in a handler (a remote request, a disk read): the
        worker's channel goes on being read by a new thread, and this thread
        ends once its request is answered. Anywhere else (not a worker, a
        thread already handed off, MAX_WAITING reached, the session ending)
        nothing changes."""
        w = getattr(self._local, "worker", None)
        if w is not None and not self.ended.is_set():
            with self._lock:
                if self._waiting < MAX_WAITING:
                    self._waiting += 1
                    self.handoffs += 1
                    self._running += 1
                    self._local.worker = None  # (the request now counts in _waiting)
                    w.busy = False
                    w.thread = threading.Thread(target=self._run, args=(w,), daemon=True,
                                                name=w.thread.name if w.thread else None)
                    w.thread.start()
        yield

    def op_counts(self) -> dict[str, int]:
        """Requests read, by operation name."""
        out: dict[str, int] = {}
        for w in self.workers:
            for op, n in enumerate(w.ops):
                if n:
                    name = s.OP_NAMES.get(op, "other")
                    out[name] = out.get(name, 0) + n
        return out

    # the workers

    def _run(self, w: Worker) -> None:
        ch = w.channel
        local = self._local
        local.worker = w
        try:
            while not self.ended.is_set():
                if self._wakeable:
                    w.reading = True  # (before the check: `drain` wakes it, or it stops)
                    n = -1 if self.ended.is_set() else ch.read_or_wake()
                    w.reading = False
                    if n < 0:
                        continue  # woken: the loop's check says why
                else:
                    n = ch.read()
                if n == 0:
                    break
                w.busy = True  # (before the check: `drain` then waits for it, or it stops)
                if self._sweeping and n >= s.IN_HEADER.size:
                    self._sweep(s.IN_HEADER.unpack_from(ch.view)[2])
                if self._draining:
                    self.read_draining += 1
                    if not self._wakeable:
                        w.busy = False  # left unanswered: the successor has it resent
                        break
                try:
                    self._serve(ch, n, w)
                finally:
                    if local.worker is w:
                        w.busy = False
                    else:  # handed its channel on while waiting: answered, and done
                        with self._lock:
                            self._waiting -= 1
                if local.worker is not w:
                    break
        except Exception:
            log.exception("FUSE worker %s failed; the others serve on",
                          threading.current_thread().name)
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self.ended.set()

    def _serve(self, ch: Channel, n: int, w: Worker) -> None:
        view = ch.view
        if n < s.IN_HEADER.size:
            log.warning("dropped a FUSE request of %d bytes (shorter than its header)", n)
            if n >= s.OUT_HEADER.size:
                ch.error(s.OUT_HEADER.unpack_from(view)[2], errno.EIO)
            return
        size, op, unique, nodeid, uid, _gid, _pid, _ext, _ = s.IN_HEADER.unpack_from(view)
        w.ops[op if op < _OPCODES else 0] += 1
        if size != n:
            log.warning("FUSE request %d (%s) says %d bytes but %d were read; answering EIO",
                        unique, s.OP_NAMES.get(op, op), size, n)
            ch.error(unique, errno.EIO)
            return
        body = view[s.IN_HEADER.size:n]
        if op == s.INIT:
            self._init(ch, unique, body)
        elif self.terms is None:
            ch.error(unique, errno.EIO)
        elif op == s.INTERRUPT:
            self._interrupt(ch, unique, body)
        elif op == s.DESTROY:
            self.ended.set()
            ch.reply(unique)
        else:
            timed = self.latency
            start = time.perf_counter() if timed is not None else 0.0
            self._inflight[unique] = ch
            try:
                self.dispatcher.call(op, ch, unique, nodeid, body, uid)
            finally:
                self._inflight.pop(unique, None)
                if timed is not None:
                    timed.observe(s.OP_NAMES.get(op, "other"), time.perf_counter() - start)

    def _init(self, ch: Channel, unique: int, body: memoryview) -> None:
        try:
            terms, reply = negotiate(body, self.writable)
        except ProtocolError as exc:
            log.error("%s; ending the session", exc)
            ch.error(unique, errno.EPROTO)
            self.ended.set()
            return
        if self.on_init is not None:
            self.on_init(terms)
        self.terms = terms
        self._wakeable = not terms.resends
        log.info("FUSE %d.%d (kernel offers 7.%d%s): flags %#x, max_pages %d", terms.major,
                 terms.minor, s.INIT_IN_OLD.unpack_from(body)[1],
                 f", {FORCED_MINOR} caps it" if forced_minor() is not None else "",
                 terms.flags, terms.max_pages)
        ch.reply(unique, (reply,))

    def _interrupt(self, ch: Channel, unique: int, body: memoryview) -> None:
        target = s.INTERRUPT_IN.unpack_from(body)[0]
        held = self._inflight.get(target)
        if held is not None:
            held.error(target, errno.EINTR)
        elif self._wakeable and any(w.channel.error(target, errno.EINTR)
                                    for w in self.workers):
            pass  # (before 7.40) a request a killed server read: nothing else ends it
        else:  # answered already, or read by a worker not yet at `_serve`'s register
            ch.error(unique, errno.EAGAIN)


def _woken(_signum: int, _frame: Any) -> None:
    """WAKE_SIGNAL's handler: the interrupted read is the point."""


def _default_terms(writable: bool) -> Negotiated:
    """The terms the buffers are sized by before INIT: what `negotiate` will grant."""
    return Negotiated(major=s.KERNEL_MAJOR, minor=s.KERNEL_MINOR, flags=0, offered=0,
                      max_readahead=0, max_write=max_write(writable), max_pages=0,
                      max_background=0, congestion_threshold=0)
