"""`AsyncClient`: the asyncio socket client of `blockcached`.

The same operations and failure split as `Client` (client.py): concurrent
calls pipeline on one connection, each with a timeout.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from ..contract import protocol
from ..contract.errors import DaemonUnavailable, ProtocolError
from ..contract.protocol import LENGTH
from .client import DEFAULT_TIMEOUT
from .ops import DaemonOps, result_of
from .peercheck import check_peer, configured_daemon_uid


class AsyncClient(DaemonOps):
    """asyncio client; concurrent calls pipeline on one connection."""

    def __init__(self, socket_path: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 daemon_uid: int | None = None):
        self.socket_path = socket_path or protocol.default_socket()
        self.timeout = timeout
        self.daemon_uid = configured_daemon_uid(daemon_uid)
        self.peer_uid: int | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._connecting: asyncio.Lock | None = None

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        task, self._reader_task = self._reader_task, None
        if task is not None:
            task.cancel()
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass
        self._fail_pending("connection closed")

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _fail_pending(self, why: str) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(DaemonUnavailable(f"blockcached at {self.socket_path}: {why}"))

    async def _ensure(self) -> asyncio.StreamWriter:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is None or self._writer.is_closing():
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_unix_connection(self.socket_path,
                                                     limit=protocol.MAX_FRAME + 8),
                        self.timeout)
                except (TimeoutError, OSError) as exc:
                    raise DaemonUnavailable(
                        f"cannot connect to blockcached at {self.socket_path}: {exc}; is the "
                        f"daemon running? (set --socket or ${protocol.SOCKET_ENV})") from None
                try:
                    self.peer_uid = check_peer(writer.get_extra_info("socket"),
                                               self.socket_path, self.daemon_uid)
                except BaseException:
                    writer.close()
                    raise
                self._writer = writer
                self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))
            return self._writer

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        why = "daemon closed the connection"
        try:
            while True:
                n = protocol.frame_length(await reader.readexactly(LENGTH.size))
                body = protocol.decode_body(await reader.readexactly(n))
                fut = self._pending.pop(body.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result(body)
                elif body.get("id") == 0:
                    why = f"daemon rejected a frame: {body.get('message')}"
                    break
        except (OSError, asyncio.IncompleteReadError, ProtocolError) as exc:
            why = str(exc) or why
        except asyncio.CancelledError:
            return
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._fail_pending(why)

    async def _call(self, op: str, args: dict[str, Any], pick: str | None = None) -> Any:
        writer = await self._ensure()
        rid = next(self._ids) % (2**32 - 1) + 1
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            writer.write(protocol.encode_frame({"id": rid, "op": op, **args}))
            reply = await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            self._pending.pop(rid, None)
            await self.close()
            raise DaemonUnavailable(f"blockcached at {self.socket_path} did not answer "
                                    f"{op!r} within {self.timeout:g}s") from None
        except OSError as exc:
            self._pending.pop(rid, None)
            await self.close()
            raise DaemonUnavailable(f"blockcached at {self.socket_path}: {exc}") from None
        return result_of(reply, pick)
