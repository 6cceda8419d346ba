"""The unix socket server: framing, fairness, peer credentials.

Built on `asyncio.Protocol` rather than streams: a request is parsed and
answered as soon as it is read, with no coroutine, task or timer per
request (this halves the daemon's CPU per lookup); a whole small frame
arriving alone is answered straight from the shared read buffer, and a large
one (a put's block) is read straight into a pooled buffer of its own and
decoded with the block as a view of it (`buffers.FramePool`). Each connection answers its
requests in order, one at a time; a client that pipelines has its later frames
wait in its buffer. What keeps one client from hurting the others:

- at most `FAIR_EVERY` frames are answered per turn of the event loop, then
  the connection yields (reading paused) and continues on the next turn;
- a request must arrive whole within `frame_timeout` (30 s) of its first
  byte, and a connection's first request within it of the connect: one
  that sends nothing, or half a length prefix, is closed (once a request
  was answered, an idle connection is a reader waiting: it stays);
- bodies over `SMALL_FRAME` are read only within a global byte budget
  (`READ_BUDGET`): a connection that cannot get budget stops reading until
  another frame releases some, so many big puts at once cannot exhaust memory;
  a connection holding budget must finish its body within `BUDGETED_TIMEOUT`
  (readers send a block in one write), and a non-admin peer uid may hold at
  most `READ_BUDGET_SHARE` of it, all of them together all but
  `READ_BUDGET_RESERVED`, so stalled peers never keep an admin's fill out
  and keep another uid's out for a few seconds at most;
- replies beyond `WRITE_HIGH_WATER` unsent bytes pause reading from that
  client until it reads them, so a client that never reads stalls only itself;
- connections: at most 4,096, the last 256 for admins, and
  `max_connections_per_uid` per peer uid (`connlimits`; more are refused at
  accept);
- per peer uid (SO_PEERCRED): at most `max_reply_bytes_per_uid` bytes
  of replies unread over all of them (a request whose reply would pass it
  gets `busy`), so many connections that never read cannot pin memory;
- a frame that cannot be parsed gets an error reply with id 0 and the
  connection is closed (its framing can no longer be trusted);
- a `wait` (leases.py) is answered when its lease ends (within `lease_timeout`);
  the connection reads nothing meanwhile: one wait at a time, replies in order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from blockcache_client.contract import protocol
from blockcache_client.contract.errors import ProtocolError
from blockcache_client.contract.protocol import ErrorCode

from .buffers import ByteBudget, IdleTrimmedPool
from .config import Config
from .connlimits import ConnectionLimits
from .daemonarea import DaemonArea, pass_area
from .service import Peer, Service
from .unixsocket import bind_socket, peer_of

log = logging.getLogger(__name__)

BUDGETED_TIMEOUT = 5.0        # a body holding READ_BUDGET bytes must arrive this fast
SMALL_FRAME = 64 << 10        # bodies up to this size skip the byte budget
READ_BUDGET = 128 << 20       # bytes of large frame bodies being read at once
READ_BUDGET_SHARE = 32 << 20  # of it, what one non-admin peer uid may hold (> MAX_FRAME)
READ_BUDGET_RESERVED = 32 << 20  # of it, what only admins may hold
WRITE_HIGH_WATER = 1 << 20    # stop reading a client with this much unsent reply data
FAIR_EVERY = 32
READ_SIZE = 256 << 10         # bytes read from a socket at once
SMALL_REPLY = 64 << 10        # replies up to this size skip the per-uid unread check


class Connection(asyncio.BufferedProtocol):
    """One client connection.

    A `BufferedProtocol`: the transport reads into the server's one shared
    `read_buffer` (safe: `buffer_updated` consumes it before the loop reads
    again), where a plain `Protocol` gets a fresh 256 KiB bytes object per
    read, which costs an mmap, an mremap and a munmap on every request.
    """

    def __init__(self, server: Server):
        self.server = server
        self.svc = server.service
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.peer = Peer(0, -1, -1)
        self.buf = bytearray()
        self.need = 0             # body length of the frame being read (0 = none)
        # A large frame's body is read straight into a pooled buffer, not
        # appended to `buf`: `frame` views its first `need` bytes, `filled` of
        # them read so far. The live view is what keeps the pool from handing
        # the buffer to another connection meanwhile.
        self.frame: memoryview | None = None
        self.filled = 0
        self.budgeted = 0         # bytes of READ_BUDGET this connection holds
        self.waiting_budget = False
        self.timer: asyncio.TimerHandle | None = None
        self.timer_budgeted = False  # `timer` is BUDGETED_TIMEOUT's
        self.paused_for: set[str] = set()
        self.scheduled = False
        self.closed = False
        self.area: DaemonArea | None = None  # set by the `area` op (daemonarea.py)
        self.admin = False        # an admin peer (connlimits.ADMIN_RESERVED is theirs)
        self.budget_owner: int | None = None  # whose share of the read budget: None, admin's

    # -- transport callbacks -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        svc = self.svc
        try:
            self.peer = peer_of(transport.get_extra_info("socket"))
        except OSError as exc:
            log.warning("cannot read peer credentials: %s; closing", exc)
            self.closed = True
            transport.abort()
            return
        self.admin = svc.access.is_admin(self.peer)
        self.budget_owner = None if self.admin else self.peer.uid
        refused = self.server.limits.admit(self, self.peer.uid, self.admin)
        if refused is not None:
            svc.refusals.note("connections", self.peer, refused)
            self.closed = True
            transport.abort()
            return
        svc.connections += 1
        svc.connections_total += 1
        self.server.connections.add(self)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self._wait_body()  # its first request, within frame_timeout

    def connection_lost(self, exc: Exception | None) -> None:
        if (self.buf or self.frame is not None) and not self.closed:
            self.svc.count_error(ErrorCode.BAD_FRAME)  # hung up mid-frame
        if self in self.server.connections:
            self.server.connections.discard(self)
            self.svc.connections -= 1
            self.server.limits.release(self, self.peer.uid, self.admin)
        self.closed = True
        self._drop_frame_state()
        self.buf = bytearray()
        self.area = None  # closed once the writes still reading its slots are done
        self.svc.leases.gone(self)  # its leases are lost to their waiters

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.frame is not None:
            # the rest of a large frame's body, and nothing after it
            return self.frame[self.filled:]
        return self.server.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self.frame is not None:
            self.filled += nbytes
            if self.filled == self.need and not self.scheduled:
                self._process()
            return
        data = self.server.read_buffer[:nbytes]
        if not self.buf and not self.scheduled and not self.paused_for and not self.closed:
            # The common case: one whole small frame in one read (a reader
            # waiting for its reply). Answer it straight from the read
            # buffer: no copy into the connection's buffer, no framing loop.
            # The prefix checks are the slow path's: 0 < n <= SMALL_FRAME is
            # within MAX_FRAME and needs no read budget; anything else takes
            # the slow path.
            n = nbytes - 4
            if 0 < n <= SMALL_FRAME and int.from_bytes(data[:4], "big") == n:
                if self.timer is not None:  # the first request's: it came
                    self._drop_frame_state()
                self._answer(data[4:])
                return
            # The first read of a large frame (a put) with budget to spare:
            # its body goes straight into the frame's own buffer, not through
            # the connection's (which would be grown to 256 KiB, mmapped and
            # faulted in, for every put).
            n = int.from_bytes(data[:4], "big") if nbytes >= 4 else 0
            if SMALL_FRAME < n <= protocol.MAX_FRAME and nbytes <= 4 + n \
                    and self.server.budget.try_acquire(n, self.budget_owner):
                self.need = self.budgeted = n
                self._start_frame(n, data[4:])
                self._process()
                return
        self.buf += data
        if not self.scheduled:
            self._process()

    def pause_writing(self) -> None:
        self._pause("write")

    def resume_writing(self) -> None:
        self._resume("write")

    # -- framing -------------------------------------------------------------

    def _process(self) -> None:
        """Answer complete frames in the buffer, at most FAIR_EVERY per turn."""
        self.scheduled = False
        buf = self.buf
        paused = self.paused_for
        for _ in range(FAIR_EVERY):
            if self.closed or (paused and (len(paused) > 1 or "turn" not in paused)):
                return
            if not self.need:
                if len(buf) < 4:
                    if buf:  # half a length prefix must become a request too
                        self._wait_body()
                    return
                try:
                    n = protocol.frame_length(bytes(buf[:4]))
                except ProtocolError as exc:
                    return self._fatal(exc)
                self.need = n
                if n > SMALL_FRAME and not self._get_budget(n):
                    return
            n = self.need
            if n > SMALL_FRAME:
                if self.frame is None:
                    del buf[:4 + self._start_frame(n, memoryview(buf)[4:])]
                if self.filled < n:
                    self._wait_body()
                    return
                frame, self.frame = self.frame, None
                # its bin values (a put's block) stay views of `frame`
                answered = self._answer(frame, views=True)
            elif len(buf) < 4 + n:
                self._wait_body()
                return
            else:
                # unpack in place; `_answer` releases the view before the
                # buffer shrinks
                answered = self._answer(memoryview(buf)[4:4 + n])
                del buf[:4 + n]
            self._drop_frame_state()
            if not answered:
                return
        if len(buf) >= 4 and not self.closed:
            # more is buffered: let other connections run first
            self._pause("turn")
            self.scheduled = True
            self.loop.call_soon(self._next_turn)

    def _start_frame(self, n: int, read: memoryview) -> int:
        """Give the large frame being read a buffer of its own, holding the
        body bytes already `read`; the rest is read straight into it. Returns
        how many bytes of `read` it took."""
        frame = self.frame = memoryview(self.server.take_frame(n))[:n]
        got = min(n, len(read))
        frame[:got] = read[:got]
        read.release()
        self.filled = got
        return got

    def _wait_body(self) -> None:
        if self.timer is not None:
            if not self.budgeted or self.timer_budgeted:
                return
            self.timer.cancel()  # the body holds read budget now: it has less time
        self.timer_budgeted = bool(self.budgeted)
        timeout = BUDGETED_TIMEOUT if self.budgeted else self.server.cfg.frame_timeout
        self.timer = self.loop.call_later(timeout, self._frame_timeout)

    def _answer(self, view: memoryview, views: bool = False) -> bool:
        """Decode one frame body, handle it and write the reply. Releases
        `view` once decoded (with `views`, big bin values stay views of its
        buffer). False if the frame could not be trusted (the connection is
        then closing)."""
        try:
            body = protocol.decode_request(view, views)
            rid = protocol.request_id(body)
        except ProtocolError as exc:
            view.release()
            self._fatal(exc)
            return False
        view.release()
        reply = self.svc.handle(body, self.peer, self)
        del body
        if reply is None:  # a wait: `answer_later` replies
            self._pause("wait")
            return True
        try:
            frame = protocol.encode_frame(reply)
        except ProtocolError as exc:
            self.svc.count_error(exc.code)
            frame = protocol.encode_frame(protocol.error(rid, ErrorCode.INTERNAL, exc.message))
        if len(frame) > SMALL_REPLY or self.transport.get_write_buffer_size():  # type: ignore[union-attr]
            frame = self._within_reply_budget(rid, frame)
        if self.area is not None and not self.area.passed:
            return self._send_area(rid, frame)
        self.transport.write(frame)  # type: ignore[union-attr]
        return True

    def answer_later(self, rid: int, outcome: str) -> None:
        """Reply to this connection's `wait`, then read its requests again."""
        if not self.closed:
            self.transport.write(protocol.encode_frame(protocol.ok(rid, outcome=outcome)))  # type: ignore[union-attr]
            self._resume("wait")

    def _send_area(self, rid: int, frame: bytes) -> bool:
        """Send the reply to `area` with the area's memfd attached (`pass_area`)."""
        try:
            sent = pass_area(self.transport, self.area, frame)
        except OSError as exc:
            sent = 0
            log.warning("cannot pass a fill area to uid %d (pid %d): %s", self.peer.uid,
                        self.peer.pid, exc)
            self.area = None
            self.svc.count_error(ErrorCode.INTERNAL)
            frame = protocol.encode_frame(protocol.error(
                rid, ErrorCode.INTERNAL, f"cannot pass the fill area: {exc}; put blocks by value"))
        if sent < len(frame):
            self.transport.write(frame[sent:])  # type: ignore[union-attr]
        return True

    def _within_reply_budget(self, rid: int, frame: bytes) -> bytes:
        """`frame`, or a `busy` error if the peer's uid already has
        `max_reply_bytes_per_uid` bytes of replies unread over all its
        connections (a first reply always goes: nothing is then unread).
        Asked only for big replies or a connection with unsent data, so the
        usual small reply pays nothing."""
        limit = self.server.cfg.max_reply_bytes_per_uid
        if not limit:
            return frame
        unread = sum(c.transport.get_write_buffer_size()  # type: ignore[union-attr]
                     for c in self.server.limits.of_uid(self.peer.uid) if not c.closed)
        if not unread or unread + len(frame) <= limit:
            return frame
        self.svc.refusals.note("reply_bytes", self.peer, f"{unread} bytes unread")
        self.svc.count_error(ErrorCode.BUSY)
        return protocol.encode_frame(protocol.error(
            rid, ErrorCode.BUSY, f"uid {self.peer.uid} has {unread} bytes of replies not yet "
                                 f"read (max_reply_bytes_per_uid {limit}); read them first"))

    def _next_turn(self) -> None:
        self.paused_for.discard("turn")
        if not self.paused_for and not self.closed:
            self.transport.resume_reading()  # type: ignore[union-attr]
        self._process()

    def _get_budget(self, n: int) -> bool:
        budget, owner = self.server.budget, self.budget_owner
        if budget.try_acquire(n, owner):
            self.budgeted = n
            return True
        if budget.held_back(n, owner):
            self.svc.refusals.note("read_budget", self.peer, f"{budget.held.get(owner, 0)} "
                                                             f"bytes held")
        self.waiting_budget = True
        self._pause("budget")
        budget.wait(n, owner, self._budget_granted)
        return False

    def _budget_granted(self) -> None:
        self.waiting_budget = False
        self.budgeted = self.need
        if self.closed:
            self._drop_frame_state()
            return
        self._resume("budget")

    def _drop_frame_state(self) -> None:
        self.need = 0
        self.frame = None
        self.filled = 0
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.budgeted:
            n, self.budgeted = self.budgeted, 0
            self.server.budget.release(n, self.budget_owner)
        if self.waiting_budget:
            self.waiting_budget = False
            self.server.budget.forget(self._budget_granted)

    def _pause(self, why: str) -> None:
        if not self.paused_for and not self.closed:
            self.transport.pause_reading()  # type: ignore[union-attr]
        self.paused_for.add(why)

    def _resume(self, why: str) -> None:
        self.paused_for.discard(why)
        if not self.paused_for and not self.closed:
            self.transport.resume_reading()  # type: ignore[union-attr]
            if not self.scheduled:
                self.scheduled = True
                self.loop.call_soon(self._process)

    def _frame_timeout(self) -> None:
        self.timer = None
        self.svc.count_error(ErrorCode.BAD_FRAME)
        log.info("closing a connection (uid %d, pid %d): request not complete within %ss",
                 self.peer.uid, self.peer.pid,
                 BUDGETED_TIMEOUT if self.budgeted else self.server.cfg.frame_timeout)
        self._close()

    def _fatal(self, exc: ProtocolError) -> None:
        """A frame we cannot trust: answer with id 0 and close."""
        self.svc.count_error(exc.code)
        if self.transport is not None and not self.closed:
            self.transport.write(protocol.encode_frame(protocol.error(0, exc.code, exc.message)))
        self._close()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self._drop_frame_state()
            self.buf.clear()
            if self.transport is not None:
                self.transport.close()  # flushes the pending reply first


class Server:
    """Listens on the configured unix socket and serves `Service`."""

    def __init__(self, cfg: Config, service: Service):
        self.cfg = cfg
        self.service = service
        self.loop = asyncio.get_running_loop()
        self.budget = ByteBudget(READ_BUDGET, READ_BUDGET_SHARE, READ_BUDGET_RESERVED)
        self.frames = IdleTrimmedPool(self.loop)
        # what every connection reads into (see `Connection`); the size of a
        # read, as asyncio's own default
        self.read_buffer = memoryview(bytearray(READ_SIZE))
        self.connections: set[Connection] = set()
        self.limits: ConnectionLimits[Connection] = ConnectionLimits(
            cfg.max_connections_per_uid)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        path = self.cfg.socket
        sock = bind_socket(self.cfg)
        # a restarted daemon is reconnected to by every reader at once
        sock.listen(socket.SOMAXCONN)
        self._server = await self.loop.create_unix_server(lambda: Connection(self), sock=sock)
        log.info("serving on %s (mode %o)", path, self.cfg.socket_mode)

    def take_frame(self, n: int) -> bytearray:
        """A pooled buffer for a large frame of `n` bytes (see `buffers.FramePool`)."""
        return self.frames.take(n)

    async def close(self) -> None:
        """Stop accepting, close every connection, remove the socket."""
        self.frames.close()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn._close()
        await asyncio.sleep(0)  # let the transports finish closing
        try:
            os.unlink(self.cfg.socket)
        except FileNotFoundError:
            pass
