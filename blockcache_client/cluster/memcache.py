"""A small memcached client: the text protocol's get, add, set and delete, with
millisecond timeouts, optional TLS, and a few pooled connections per server.

Why not pymemcache: it reads values 4 KiB per recv(2) in Python, about 70 ms
for the 5 items of a 4 MiB block on our 2-CPU test machine; a buffered file
over the socket reads them with few large reads, about 10x faster, and
`get_into` reads each value straight into the place its caller chose (a
block's slices into one buffer: no per-value buffers, no join). Only what
the tier needs is here: values are bytes, flags 0, no expiry.

Errors: `ServerFailed` (an OSError) when the server or the way to it failed
(refused, reset, timed out, a reply that makes no sense): the caller skips the
server. `Refused` when the server answered with an error (CLIENT_ERROR,
SERVER_ERROR: an item too large, out of memory): the server is fine.

What a server (or anyone impersonating it: TLS is optional) can cost a
caller is bounded before it is spent:
- time: a request has a deadline, `timeout` plus its bytes at `MIN_RATE`;
  every recv waits at most until then, so a value trickling in is cut off;
- memory: a get names the size of each value it asks for, and a `VALUE`
  line declaring another size, a second `VALUE` for a name, or one for a
  name not asked for fails the server before anything is allocated or read.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence

# where a value goes: (key, size) -> writable views holding `size` bytes in all
Place = Callable[[str, int], Sequence[memoryview]]
_IDLE_KEPT = 16  # idle connections kept per server (reader threads at once)
# The slowest a request's bytes may arrive (after the first `timeout`): a
# 4 MiB block gets 1 s more. A tier slower than this is slower than the remote
# it saves, so cutting it off costs nothing a reader would miss.
MIN_RATE = 4 << 20
_MAX_LINE = 4096  # a reply line longer than this is garbage


class ServerFailed(OSError):
    """The server did not answer properly: skip it for a while. `timed_out`:
    it did not answer in time (stalled, or busy), rather than refused, reset
    or garbled (gone or broken): only a probe can tell which (`answers`).
    `bad_item`: the item whose declared size was wrong (it may be poison
    stored there: the caller can delete it)."""

    def __init__(self, message: str, timed_out: bool = False, bad_item: str | None = None):
        super().__init__(message)
        self.timed_out = timed_out
        self.bad_item = bad_item


class Refused(Exception):
    """The server answered with an error for this request."""


class _Conn:
    """A connection, and the deadline of the request it is serving: every
    wait for bytes ends by then (`pace`)."""

    __slots__ = ("sock", "file", "timeout", "deadline", "shortened")

    def __init__(self, sock: socket.socket, timeout: float):
        self.sock = sock
        self.file = sock.makefile("rb", buffering=1 << 16)
        self.timeout = timeout
        self.deadline = 0.0
        self.shortened = False  # the socket's timeout is cut to the deadline

    def start(self, seconds: float) -> None:
        """A request begins: it must be answered within `seconds`."""
        self.deadline = time.monotonic() + seconds
        if self.shortened:  # the last request's end cut it: each recv may wait `timeout`
            self.sock.settimeout(self.timeout)
            self.shortened = False

    def pace(self) -> None:
        """Before a recv: wait at most `timeout`, and never past the deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ServerFailed("memcached missed the request's deadline", timed_out=True)
        if left < self.timeout:
            self.sock.settimeout(left)
            self.shortened = True

    def read_into(self, view: memoryview) -> None:
        """Fill `view` from the socket: one recv per step, each paced (a
        buffered `readinto` would wait `timeout` per recv, without end)."""
        while view:
            self.pace()
            n = self.file.readinto1(view)
            if not n:
                raise ServerFailed("memcached closed the connection mid-value")
            view = view[n:]

    def line(self) -> bytes:
        """The next reply line, without its CRLF; at most `_MAX_LINE` bytes."""
        parts = []
        size = 0
        while True:
            self.pace()
            ahead = self.file.peek(1)  # the buffered bytes, or one paced recv
            if not ahead:
                raise ServerFailed("memcached closed the connection")
            end = ahead.find(b"\n", 0, _MAX_LINE + 2 - size)
            part = self.file.read(len(ahead) if end < 0 else end + 1)
            parts.append(part)
            size += len(part)
            if end >= 0:
                break
            if size > _MAX_LINE:
                raise ServerFailed("memcached sent a line without an end")
        line = b"".join(parts)
        if not line.endswith(b"\r\n"):
            raise ServerFailed("memcached sent a line without an end")
        return line[:-2]

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class Memcache:
    """One memcached server at `address`; methods are thread-safe."""

    def __init__(self, address: tuple[str, int], connect_timeout: float, timeout: float,
                 tls: ssl.SSLContext | None = None, server_name: str | None = None):
        self.address = address
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._tls = tls
        self._server_name = server_name or address[0]  # what the certificate must name
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- requests --------------------------------------------------------------------

    def get_into(self, sizes: dict[str, int], place: Place,
                 landed: Callable[[str], None] | None = None) -> list[str]:
        """Read the values of the keys the server holds ({key: the size its
        value must have}) where `place(key, size)` says: writable views whose
        lengths add up to `size`, filled in turn straight from the socket
        (large reads bypass the buffer: no copies). `landed(key)` is called
        as each value is in, while the later ones arrive. The keys whose
        values were read whole, in the server's order. Within `timeout`
        plus the sizes at `MIN_RATE`, or ServerFailed."""
        if not sizes:
            return []
        done: list[str] = []
        seen: set[str] = set()

        def talk(c: _Conn) -> None:
            c.sock.sendall(b"get " + " ".join(sizes).encode() + b"\r\n")
            while True:
                line = c.line()
                if line == b"END":
                    return
                parts = line.split()
                if len(parts) < 4 or parts[0] != b"VALUE":
                    _answer_error(line, "get")
                key = parts[1].decode()
                want = sizes.get(key)
                if want is None or key in seen:
                    raise ServerFailed(f"memcached {self.name}: answered {key!r} "
                                       f"{'twice' if want is not None else 'not asked for'}")
                if parts[3] != b"%d" % want:  # before a byte of it is read or placed
                    raise ServerFailed(f"memcached {self.name}: declares {parts[3][:20]!r} "
                                       f"bytes for {key}, where {want} belong", bad_item=key)
                views = place(key, want)
                if sum(map(len, views)) != want:  # our bug, not the server's
                    raise RuntimeError(f"place gave room for {sum(map(len, views))} bytes "
                                       f"of {key}'s {want}")
                for view in views:
                    c.read_into(view)
                crlf = memoryview(bytearray(2))
                c.read_into(crlf)
                if crlf != b"\r\n":
                    raise ServerFailed(f"memcached {self.name}: a value was cut short")
                done.append(key)
                seen.add(key)
                if landed is not None:
                    landed(key)

        self._use(talk, self._timeout + sum(sizes.values()) / MIN_RATE)
        return done

    def add(self, key: str, value: bytes) -> bool:
        """Store `value` unless the server holds `key` already; whether it did."""
        return self._store(b"add", key, value)

    def set(self, key: str, value: bytes) -> bool:
        """Store `value` whatever the server holds."""
        return self._store(b"set", key, value)

    def _store(self, verb: bytes, key: str, value: bytes) -> bool:
        def talk(c: _Conn) -> bool:
            c.sock.sendall(b"%s %s 0 0 %d\r\n" % (verb, key.encode(), len(value)))
            c.sock.sendall(value)
            c.sock.sendall(b"\r\n")
            line = c.line()
            if line == b"STORED":
                return True
            if line in (b"NOT_STORED", b"EXISTS"):
                return False
            return _answer_error(line, verb.decode())

        return self._use(talk, self._timeout + len(value) / MIN_RATE)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete the keys (pipelined: one write, then the answers)."""
        keys = list(keys)
        if not keys:
            return

        def talk(c: _Conn) -> None:
            c.sock.sendall(b"".join(b"delete %s\r\n" % k.encode() for k in keys))
            for _ in keys:
                line = c.line()
                if line not in (b"DELETED", b"NOT_FOUND"):
                    _answer_error(line, "delete")

        self._use(talk, self._timeout)

    # -- connections -----------------------------------------------------------------

    @property
    def name(self) -> str:
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _use(self, talk, seconds: float):
        """Run `talk` on an idle connection (or a new one), within `seconds`;
        a connection that failed or left a reply unread is closed, never reused."""
        with self._lock:
            c = self._idle.pop() if self._idle else None
        if c is None:
            c = self._connect()
        try:
            c.start(seconds)
            result = talk(c)
        except Refused:
            c.close()  # the rest of its reply may still be on the way
            raise
        except (OSError, ValueError) as exc:
            c.close()
            if isinstance(exc, ServerFailed):
                raise
            raise ServerFailed(f"memcached {self.name}: {type(exc).__name__}: {exc}",
                               timed_out=isinstance(exc, TimeoutError)) from exc
        except BaseException:
            c.close()  # the caller's error mid-reply: the rest of it is unread
            raise
        with self._lock:
            if len(self._idle) < _IDLE_KEPT and not self._closed:
                self._idle.append(c)
                c = None
        if c is not None:
            c.close()
        return result

    def _connect(self) -> _Conn:
        try:
            sock = socket.create_connection(self.address, timeout=self._connect_timeout)
        except OSError as exc:
            raise ServerFailed(f"memcached {self.name}: cannot connect: {exc}",
                               timed_out=isinstance(exc, TimeoutError)) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:  # the handshake within the connect timeout
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_name)
            sock.settimeout(self._timeout)
        except (OSError, ValueError) as exc:
            sock.close()
            raise ServerFailed(f"memcached {self.name}: TLS handshake failed: {exc}",
                               timed_out=isinstance(exc, TimeoutError)) from exc
        return _Conn(sock, self._timeout)

    def answers(self, within: float) -> bool:
        """Whether the server answers `version` within `within` seconds, on a
        connection of its own: a busy server does, a stalled one does not."""
        try:
            c = self._connect()
        except ServerFailed:
            return False
        try:
            c.timeout = within
            c.start(within)
            c.sock.sendall(b"version\r\n")
            return c.line().startswith(b"VERSION")
        except (OSError, ValueError):
            return False
        finally:
            c.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()


def _answer_error(line: bytes, what: str):
    """Raise for an answer that is not the one expected."""
    if line.startswith((b"CLIENT_ERROR", b"SERVER_ERROR")):
        raise Refused(f"{what}: {line.decode(errors='replace')}")
    raise ServerFailed(f"{what}: unexpected answer {line[:80]!r}")
