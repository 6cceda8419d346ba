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
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import structs as s
from .channel import Channel
from .negotiate import MAX_WRITE, Negotiated, ProtocolError, negotiate
from .requests import Dispatcher, Operations

log = logging.getLogger(__name__)

_OPCODES = 64  # per-opcode counters; larger opcodes count under 0
# Requests waiting (a remote fetch, a listing) on threads of their own at once,
# at most; past that a wait holds its worker.
MAX_WAITING = 64


class Worker:
    """One thread's channel and its counters."""

    __slots__ = ("channel", "thread", "ops", "busy")

    def __init__(self, channel: Channel):
        self.channel = channel
        self.thread: threading.Thread | None = None
        self.ops = [0] * _OPCODES
        self.busy = False


class Session:
    """One FUSE connection served by `workers` threads."""

    def __init__(self, ops: Operations, workers: int, clone: bool = True,
                 terms: Negotiated | None = None):
        self.ops = ops
        self.fd = -1
        self.nworkers = max(1, workers)
        self.clone = clone
        self.dispatcher = Dispatcher(ops)
        # set once INIT is answered (or given: a session taken over)
        self.terms = terms
        self.buffer_size = (terms or _DEFAULT_TERMS).buffer_size()
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
        self._local = threading.local()  # .worker: the Worker whose channel this thread reads
        self._draining = False  # handing over: a request read now is left to the successor
        self._lock = threading.Lock()

    # lifecycle

    def start(self, fd: int, channel_fds: Sequence[int] = ()) -> None:
        """Start the workers: the first on the mount's descriptor `fd` (which the
        caller keeps and closes), the rest on `channel_fds` (the keeper's clones,
        also kept by the caller) and then on clones made here."""
        self.fd = fd
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
        self._running = len(self.workers)
        for w in self.workers:
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
        were answered. Workers blocked in a read stay there: a request one of
        them takes now is left unanswered, for the successor's resend."""
        self._draining = True
        self.ended.set()
        deadline = time.monotonic() + timeout
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self.busy()

    def notify_store(self, nodeid: int, offset: int, data: bytes | memoryview) -> None:
        """Put file data into the kernel's page cache (see `Channel.notify_store`)."""
        self.workers[0].channel.notify_store(nodeid, offset, data)

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
                n = ch.read()
                if n == 0:
                    break
                w.busy = True  # (before the check: `drain` then waits for it, or it stops)
                if self._draining:
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
            terms, reply = negotiate(body)
        except ProtocolError as exc:
            log.error("%s; ending the session", exc)
            ch.error(unique, errno.EPROTO)
            self.ended.set()
            return
        if self.on_init is not None:
            self.on_init(terms)
        self.terms = terms
        log.info("FUSE %d.%d (kernel offers 7.%d): flags %#x, max_pages %d", terms.major,
                 terms.minor, s.INIT_IN_OLD.unpack_from(body)[1], terms.flags, terms.max_pages)
        ch.reply(unique, (reply,))

    def _interrupt(self, ch: Channel, unique: int, body: memoryview) -> None:
        target = s.INTERRUPT_IN.unpack_from(body)[0]
        held = self._inflight.get(target)
        if held is not None:
            held.error(target, errno.EINTR)
        else:  # answered already, or read by a worker not yet at `_serve`'s register
            ch.error(unique, errno.EAGAIN)


# The buffer size before INIT: what `negotiate` will grant.
_DEFAULT_TERMS = Negotiated(major=s.KERNEL_MAJOR, minor=s.KERNEL_MINOR, flags=0, offered=0,
                            max_readahead=0, max_write=MAX_WRITE, max_pages=0,
                            max_background=0, congestion_threshold=0)
