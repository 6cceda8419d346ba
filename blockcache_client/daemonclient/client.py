"""`Client`: the blocking socket client of `blockcached` (and `AsyncClient`'s
defaults: asyncclient.py).

Both speak `protocol` and expose the same operations (ops.py); every
call has a timeout. Failures split in two, so callers can fail open:

- `DaemonUnavailable`: the socket is missing, refused, closed, or the daemon
  did not answer in time. The connection is dropped and the next call
  reconnects.
- `DaemonError`: the daemon answered with an error reply (`.code` is one of
  `protocol.ErrorCode`). The connection stays usable.

Whoever answers on the socket must be the daemon (peercheck.py): anyone
else is treated as no daemon.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import struct
import threading
import time
from typing import Any

from ..common.forks import generation as _forks
from ..contract import protocol
from ..contract.errors import (
    DaemonError,
    DaemonUnavailable,
    ProtocolError,
)
from ..contract.protocol import LENGTH
from .ops import DaemonOps, result_of
from .peercheck import check_peer, configured_daemon_uid

DEFAULT_TIMEOUT = 5.0
# Asked for the socket's send buffer: room for a whole put, so its block goes
# out in one sendmsg and the daemon takes it in one or two reads, not one
# wake-up per chunk on each side. The kernel caps it at net.core.wmem_max
# (docs/deploy.md, "Socket buffers"); smaller only costs wake-ups.
SEND_BUFFER = 4 << 20
# How long a blocking client polls for a reply before it sleeps: the daemon
# answers a lookup faster than a VM wakes a halted vCPU from poll(2).
REPLY_SPIN = 100e-6


class Client(DaemonOps):
    """Blocking client; thread-safe (one request on the wire at a time, or a
    batch through `pipeline`), and fork-safe (a child reconnects)."""

    def __init__(self, socket_path: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 reply_spin: float = REPLY_SPIN, daemon_uid: int | None = None):
        self.socket_path = socket_path or protocol.default_socket()
        self.timeout = timeout
        self.daemon_uid = configured_daemon_uid(daemon_uid)
        self.peer_uid: int | None = None  # the daemon's, once connected
        self.reply_spin = reply_spin
        self._spin_skip = self._spin_backoff = 0
        self._sock: socket.socket | None = None
        self._rbuf = bytearray()  # bytes read ahead of the reply being parsed
        self._poll = select.poll()
        self._fork = _forks[0]
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._posted = 0  # posted requests whose replies have not been read
        self._early: list[dict[str, Any]] = []  # their replies, read by another call
        self._lost_posts = 0  # posted requests whose connection closed unanswered
        self._connects = 0  # connections made so far (`connection_id`)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        # replies already read stay for `collect`; the others never come
        self._lost_posts += self._posted
        self._posted = 0
        if sock is not None:
            sock.close()

    @property
    def connected(self) -> bool:
        """Whether this process has a connection open (calls may still fail)."""
        return self._sock is not None and self._fork == _forks[0]

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _next_id(self) -> int:
        return next(self._ids) % (2**32 - 1) + 1

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                _connect_unix(sock, self.socket_path, self.timeout)
            except OSError as exc:
                sock.close()
                raise DaemonUnavailable(f"cannot connect to blockcached at {self.socket_path}: "
                                        f"{exc.strerror or exc}; is the daemon running? "
                                        f"(set --socket or ${protocol.SOCKET_ENV})") from None
            try:
                self.peer_uid = check_peer(sock, self.socket_path, self.daemon_uid)
            except BaseException:
                sock.close()
                raise
            # Blocking I/O with kernel timeouts rather than settimeout(), which
            # polls before every send as well as every recv: replies are waited
            # for in `_wait_readable`, and sends go straight out.
            sock.settimeout(None)
            usec = max(1, round(self.timeout * 1e6))  # a zero timeval waits forever
            tv = struct.pack("ll", usec // 1_000_000, usec % 1_000_000)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            self._poll = select.poll()
            self._poll.register(sock, select.POLLIN)
            self._sock, self._rbuf = sock, bytearray()
            self._connects += 1
        return self._sock

    def _wait_readable(self) -> None:
        """Wait for reply bytes in poll(2), not in a blocking recv. Consuming
        a request signals write space on the sender's socket, which wakes
        every task sleeping in recv on it; poll waits for input only. So a
        client blocked in recv was woken for nothing (and slept again) each
        time the daemon read its request: one cross-CPU wake-up per request
        on each side, for the price of one poll call.

        Before sleeping, poll without waiting for up to `reply_spin` seconds,
        yielding the CPU between polls to anything runnable (the daemon, on a
        busy core). Only in a process with one Python thread: the spin holds
        the GIL between polls, and another thread waiting for it would lose
        more than this one gains; blocked in poll, the GIL is free. A reply
        later than the spin means the daemon is short of CPU, which pollers
        only take from it: then the next 1, 2, 4 ... 64 waits skip the spin."""
        poll = self._poll.poll
        if self.reply_spin > 0 and threading.active_count() == 1:
            if self._spin_skip:
                self._spin_skip -= 1
            else:
                deadline = time.perf_counter() + self.reply_spin
                while not poll(0):
                    if time.perf_counter() >= deadline:
                        # the daemon is not getting a CPU in time: spinning
                        # only takes one from it; sleep for the next few
                        self._spin_backoff = min(64, self._spin_backoff * 2 or 1)
                        self._spin_skip = self._spin_backoff
                        break
                    os.sched_yield()
                else:  # the reply is in
                    self._spin_backoff = 0
                    return
        if not poll(max(1, round(self.timeout * 1000))):
            raise TimeoutError

    def _recv_exact(self, sock: socket.socket, n: int) -> bytearray:
        """`n` bytes from the stream, reading ahead in large chunks so a small
        reply costs one recv, not one for its prefix and one for its body."""
        buf = self._rbuf
        while len(buf) < n:
            self._wait_readable()
            chunk = sock.recv(max(n - len(buf), 1 << 16))
            if not chunk:
                raise ConnectionError("daemon closed the connection")
            buf += chunk
        out = buf[:n]  # one copy; the decoders take a bytearray
        del buf[:n]
        return out

    def _read_reply(self, sock: socket.socket) -> dict[str, Any]:
        """The next reply frame's body. A small reply mostly arrives whole in
        one recv: decode it straight from that chunk, with no read-ahead
        buffer and no copies of its prefix and body."""
        if not self._rbuf:
            self._wait_readable()
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("daemon closed the connection")
            if len(chunk) > LENGTH.size:
                n = protocol.frame_length(chunk[:LENGTH.size])
                if len(chunk) == LENGTH.size + n:
                    return protocol.decode_body(memoryview(chunk)[LENGTH.size:])
            self._rbuf += chunk
        n = protocol.frame_length(self._recv_exact(sock, LENGTH.size))
        return protocol.decode_body(self._recv_exact(sock, n))

    def _after_fork(self) -> None:
        if self._fork != _forks[0]:
            # Forked (a DataLoader worker): never share the parent's stream, and
            # the parent's lock may have been held by a thread that is not here.
            self._sock, self._fork, self._lock = None, _forks[0], threading.Lock()
            self._posted, self._early, self._lost_posts = 0, [], 0

    def _unavailable(self, exc: BaseException) -> DaemonUnavailable:
        """Drop the connection after `exc`; the error to raise, naming why."""
        self.close()
        # EAGAIN from a blocking socket = SO_RCVTIMEO/SO_SNDTIMEO expired
        timed_out = isinstance(exc, (TimeoutError, BlockingIOError))
        what = f"timed out after {self.timeout:g}s" if timed_out else str(exc)
        return DaemonUnavailable(f"blockcached at {self.socket_path}: {what}")

    def _exchange(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Send all requests, then collect their replies (matched by id)."""
        self._after_fork()
        with self._lock:
            try:
                sock = self._connect()
                if len(requests) == 1:
                    _send_parts(sock, protocol.frame_parts(requests[0]))
                else:
                    sock.sendall(b"".join(protocol.encode_frame(r) for r in requests))
                replies: dict[int, dict[str, Any]] = {}
                wanted = {r["id"] for r in requests}
                while len(replies) < len(requests):
                    body = self._read_reply(sock)
                    if body.get("id") == 0:  # the daemon rejected our framing
                        self.close()
                        return [body] * len(requests)
                    if body.get("id") in wanted:
                        replies[body.get("id")] = body
                    elif self._posted:  # answers come in order: earlier posts first
                        self._posted -= 1
                        self._early.append(body)
                return [replies[r["id"]] for r in requests]
            except (OSError, ProtocolError, KeyError) as exc:
                raise self._unavailable(exc) from None

    def _call(self, op: str, args: dict[str, Any], pick: str | None = None) -> Any:
        reply = self._exchange([{"id": self._next_id(), "op": op, **args}])[0]
        return result_of(reply, pick)

    # -- posted requests: sent now, answered later -------------------------------

    @property
    def posted(self) -> int:
        """Posted requests whose replies `collect` has not returned yet."""
        return self._posted + len(self._early)

    def take_lost(self) -> int:
        """How many posted requests lost their connection before their reply
        was read (since the last call): they may or may not have been done."""
        n, self._lost_posts = self._lost_posts, 0
        return n

    def post(self, op: str, args: dict[str, Any]) -> list[memoryview] | None:
        """Send one request without waiting for its reply (a fill's put: the
        sender has nothing to wait for); `collect` returns the reply later.

        Never blocks: returns the tail of the frame the socket had no room
        for, or None when all of it went. The tail is views of the frame's
        parts, a block's among them, not a copy: the caller keeps the block
        unchanged until it is sent (or copies the tail). A tail must go out
        through `finish_post` before this client sends anything else. Connects if
        not connected (that may wait for the daemon's accept backlog: check
        `connected` first where that matters). DaemonUnavailable if the
        connection is (or goes) down; this request is then not posted."""
        self._after_fork()
        with self._lock:
            try:
                parts = protocol.frame_parts({"id": self._next_id(), "op": op, **args})
                sock = self._connect()
                try:
                    sent = sock.sendmsg(parts, [], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
            except (OSError, ProtocolError) as exc:
                raise self._unavailable(exc) from None
            self._posted += 1
            if sent == sum(map(len, parts)):
                return None
            return _unsent(parts, sent)

    def finish_post(self, tail: list[memoryview] | bytes) -> None:
        """Send the tail `post` returned (or a copy of it), waiting for room
        as long as the timeout allows. DaemonUnavailable if the connection
        goes down (the request is then counted by `take_lost`)."""
        self._after_fork()
        with self._lock:
            try:
                sock = self._connect_existing()
                for part in [tail] if isinstance(tail, bytes) else tail:
                    sock.sendall(part)
            except OSError as exc:
                raise self._unavailable(exc) from None

    def collect(self, wait: bool = False) -> list[dict[str, Any]]:
        """Replies to posted requests, in posting order: those that have
        arrived, or with `wait` all of them (each within the timeout). Never
        raises: if the connection fails meanwhile, the replies read so far
        are returned and the rest are counted by `take_lost`."""
        self._after_fork()
        with self._lock:
            out, self._early = self._early, []
            try:
                while self._posted and (wait or self._rbuf or self._poll.poll(0)):
                    body = self._read_reply(self._connect_existing())
                    if body.get("id") == 0:  # the daemon rejected our framing
                        self.close()
                        break
                    self._posted -= 1
                    out.append(body)
            except (OSError, ProtocolError):
                self.close()
            return out

    def open_area(self, slots: int, slot_bytes: int) -> tuple[int, int, int]:
        """Ask for this connection's fill area (contract/fillarea.py): (its
        memfd, slots, slot_bytes). Only with nothing posted and unanswered:
        the reply that carries the descriptor must be the next to arrive.
        DaemonError if the daemon refuses (one that predates areas does),
        DaemonUnavailable if the connection fails."""
        self._after_fork()
        with self._lock:
            if self._posted or self._early or self._rbuf:
                raise RuntimeError("open_area with posted requests unanswered: collect first")
            try:
                sock = self._connect()
                sock.sendall(protocol.encode_frame({"id": self._next_id(), "op": "area",
                                                    "slots": slots, "slot_bytes": slot_bytes}))
                self._wait_readable()
                chunk, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1, socket.MSG_CMSG_CLOEXEC)
                if not chunk:
                    raise ConnectionError("daemon closed the connection")
                self._rbuf += chunk
                n = protocol.frame_length(self._recv_exact(sock, LENGTH.size))
                reply = protocol.decode_body(self._recv_exact(sock, n))
            except (OSError, ProtocolError) as exc:
                raise self._unavailable(exc) from None
        if reply.get("ok") and len(fds) == 1:
            return fds[0], int(reply["slots"]), int(reply["slot_bytes"])
        for fd in fds:
            os.close(fd)
        result_of(reply, None)  # raises the daemon's error
        raise DaemonError(protocol.ErrorCode.INTERNAL, "the daemon opened a fill area but "
                                                       "passed no descriptor with its reply")

    @property
    def connection_id(self) -> int:
        """Changes whenever this client connects anew (what a fill area
        belongs to: the connection it was opened on)."""
        return self._connects if self.connected else 0

    def _connect_existing(self) -> socket.socket:
        if self._sock is None:
            raise ConnectionError("the connection of the posted requests was closed")
        return self._sock


def _send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """sendall of the parts joined, without joining them (no copy of a put's
    block). A blocking sendmsg sends everything unless SO_SNDTIMEO or a
    signal cuts it short; then the rest goes by sendall."""
    sent = sock.sendmsg(parts)
    if sent == sum(map(len, parts)):
        return
    for rest in _unsent(parts, sent):
        sock.sendall(rest)


def _unsent(parts: list[bytes | memoryview], sent: int) -> list[memoryview]:
    """What is left of `parts` after their first `sent` bytes went out."""
    rest = []
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
        else:
            rest.append(memoryview(part)[sent:])
            sent = 0
    return rest


def _connect_unix(sock: socket.socket, path: str, timeout: float) -> None:
    """connect(2), waiting up to `timeout` while the daemon's accept backlog is
    full. A unix socket with a timeout is non-blocking underneath, and its
    connect then fails at once with EAGAIN instead of waiting as TCP's does:
    every reader on a host reconnecting to a restarted daemon at once must
    queue, not fail."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


