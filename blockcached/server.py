"""The unix socket server: framing, fairness, peer credentials.

Each connection is served by one coroutine that reads a frame, answers it and
writes the reply, so a connection has at most one request in flight and its
replies come in order; a client that pipelines simply has its later frames
wait in the socket buffer (backpressure, no unbounded queue). What keeps one
client from hurting the others:

- a frame body must arrive within `FRAME_TIMEOUT` once its length is read;
- large frame bodies are read only within a global byte budget
  (`READ_BUDGET`), so many clients sending big puts at once cannot exhaust
  memory;
- a client that does not read its replies blocks only its own coroutine
  (the write buffer is drained before the next request is read);
- the coroutine yields to the loop every `FAIR_EVERY` requests even when
  the next frame is already buffered;
- a frame that cannot be parsed gets an error reply with id 0 and the
  connection is closed (its framing can no longer be trusted).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import struct

from blockcache_client import protocol
from blockcache_client.errors import ProtocolError
from blockcache_client.protocol import LENGTH, ErrorCode

from .config import Config
from .service import Peer, Service

log = logging.getLogger(__name__)

FRAME_TIMEOUT = 30.0
SMALL_FRAME = 64 << 10        # bodies up to this size skip the byte budget
READ_BUDGET = 128 << 20       # bytes of large frame bodies being read at once
WRITE_HIGH_WATER = 1 << 20    # drain replies before reading more past this
FAIR_EVERY = 32
MAX_CONNECTIONS = 4096
_PEERCRED = struct.Struct("3i")
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


class ByteBudget:
    """An async counting limit in bytes (a semaphore whose units are bytes)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


def peer_of(sock: socket.socket | None) -> Peer:
    """The peer's pid/uid/gid and supplementary groups, from the kernel."""
    if sock is None:
        return Peer(0, -1, -1)
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     _PEERCRED.size))
    groups: tuple[int, ...] = ()
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 1024)
        groups = struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4])
    except OSError:
        pass  # older kernels: primary gid only
    return Peer(pid, uid, gid, tuple(groups))


class Server:
    """Listens on the configured unix socket and serves `Service`."""

    def __init__(self, cfg: Config, service: Service):
        self.cfg = cfg
        self.service = service
        self._server: asyncio.AbstractServer | None = None
        self._budget = ByteBudget(READ_BUDGET)
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        path = self.cfg.socket
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            # We hold <socket>.lock, so a socket left here is a dead daemon's.
            if not stat.S_ISSOCK(st.st_mode):
                raise OSError(f"{path} exists and is not a socket; remove it or choose "
                              f"another --socket")
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # never briefly world-accessible before chmod
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, self.cfg.socket_mode)
        if self.cfg.socket_group is not None:
            os.chown(path, -1, self.cfg.socket_group)
        sock.listen(512)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        log.info("serving on %s (mode %o)", path, self.cfg.socket_mode)

    async def close(self) -> None:
        """Stop accepting, close every connection."""
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        try:
            os.unlink(self.cfg.socket)
        except FileNotFoundError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        svc = self.service
        if svc.connections >= MAX_CONNECTIONS:
            log.warning("refusing a connection: %d already open", svc.connections)
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        svc.connections += 1
        svc.connections_total += 1
        try:
            peer = peer_of(writer.get_extra_info("socket"))
            await self._loop(reader, writer, peer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; nothing to answer
        except asyncio.CancelledError:
            pass
        finally:
            svc.connections -= 1
            self._tasks.discard(task)
            writer.close()

    async def _loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    peer: Peer) -> None:
        svc = self.service
        served = 0
        while True:
            try:
                prefix = await reader.readexactly(LENGTH.size)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    svc.count_error(ErrorCode.BAD_FRAME)  # hung up mid-frame
                return
            try:
                n = protocol.frame_length(prefix)
                body = await self._read_body(reader, n)
                rid = protocol.request_id(body)
            except ProtocolError as exc:
                svc.count_error(exc.code)
                writer.write(protocol.encode_frame(protocol.error(0, exc.code, exc.message)))
                await writer.drain()
                return
            except asyncio.TimeoutError:
                svc.count_error(ErrorCode.BAD_FRAME)
                log.info("closing a connection (pid %d): frame body not sent within %ss",
                         peer.pid, FRAME_TIMEOUT)
                return
            except asyncio.IncompleteReadError:
                svc.count_error(ErrorCode.BAD_FRAME)  # hung up mid-frame
                return
            reply = svc.handle(body, peer)
            del body
            try:
                frame = protocol.encode_frame(reply)
            except ProtocolError as exc:
                svc.count_error(exc.code)
                frame = protocol.encode_frame(protocol.error(rid, ErrorCode.INTERNAL, exc.message))
            writer.write(frame)
            if writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                await writer.drain()
            served += 1
            if served % FAIR_EVERY == 0:
                await asyncio.sleep(0)

    async def _read_body(self, reader: asyncio.StreamReader, n: int) -> dict:
        # asyncio.timeout, not wait_for: no task per request on the hot path
        if n <= SMALL_FRAME:
            async with asyncio.timeout(FRAME_TIMEOUT):
                data = await reader.readexactly(n)
            return protocol.decode_body(data)
        await self._budget.acquire(n)
        try:
            async with asyncio.timeout(FRAME_TIMEOUT):
                data = await reader.readexactly(n)
            return protocol.decode_body(data)
        finally:
            await self._budget.release(n)
