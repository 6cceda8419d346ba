"""HTTP/1.1 GETs (and PUTs) on plain sockets, for the S3 requests `s3direct` signs.

A cold small file is one GET, and urllib3 over http.client spent about
0.9 ms of CPU on each (building the request through several header dicts,
parsing the answer's headers with the `email` package): more than half the
reader's CPU per file, and on a host whose cores also decode samples that is
what a cold epoch waits for. A GET here is one `sendall` of the request
line and headers, one header parse (split on CRLF) and the body read with
`recv_into` into a buffer of the size asked for.

What it does: keep-alive connections per (scheme, host, port), reused unless
the server says `Connection: close`, the answer is HTTP/1.0 or its body was
not read to the end (a reused connection the server had closed meanwhile is
retried once on a new one, as urllib3 does); TLS with the caller's
`ssl.SSLContext` (certificate and host name checked unless the context says
otherwise); one timeout for connecting and for each receive. What it does
not: bodies without `Content-Length` (chunked or read to close) are only
dropped, never read (`body_known` is False: S3 gives a GetObject's length,
and `s3direct` hands any other answer to s3fs), redirects, proxies, and
connections opened ahead of their GET for a server that closes each one
(measured no faster: docs/reader.md, "S3 sources").
"""

from __future__ import annotations

import socket
import ssl
import threading

from ..common.filledbytes import FilledBytes, release

_MAX_HEAD = 64 << 10  # an answer's status line and headers; S3's are ~1 KiB
_RECV = 64 << 10


class HTTPError(OSError):
    """The server's answer is not HTTP/1.x as this client reads it, or the
    connection ended early: a temporary failure (the caller retries)."""


class Response:
    """One answer: `status`, `headers` (lower-case names), the body read with
    `read` / `readinto`; `release` after the body hands the connection back."""

    __slots__ = ("status", "headers", "length", "body_known", "_conn", "_pool", "_key",
                 "_rest", "_left", "_reusable")

    def __init__(self, status: int, headers: dict[str, str], conn: socket.socket, rest: bytes,
                 pool: Connections, key: tuple, reusable: bool):
        self.status = status
        self.headers = headers
        cl = headers.get("content-length")
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.body_known = cl is not None and cl.isdigit() and not chunked
        self.length = int(cl) if self.body_known else -1
        self._left = self.length if self.body_known else 0
        self._conn = conn
        self._pool = pool
        self._key = key
        self._rest = memoryview(rest)[:self._left]
        self._reusable = reusable and self.body_known and len(rest) <= self._left

    def readinto(self, view: memoryview) -> int:
        """Up to len(view) body bytes into `view`: fewer only where the body
        ends. HTTPError if the connection ends before the body does."""
        want = min(len(view), self._left)
        got = 0
        rest = self._rest
        if rest:
            got = min(want, len(rest))
            view[:got] = rest[:got]
            self._rest = rest[got:]
        conn = self._conn
        while got < want:
            n = conn.recv_into(view[got:want])
            if not n:
                self._reusable = False
                raise HTTPError(f"the connection closed {self._left - got} bytes before the "
                                f"end of the body")
            got += n
        self._left -= got
        return got

    def read(self, n: int) -> bytes:
        """Up to `n` body bytes, as one bytes object (received into it)."""
        n = min(n, self._left)
        if n <= 0:
            return b""
        if len(self._rest) >= n:  # already received with the headers
            out = self._rest[:n].tobytes()
            self._rest = self._rest[n:]
            self._left -= n
            return out
        # received straight into the bytes returned: a bytearray copied into
        # bytes cost ~0.1 ms of a small file's ~1 ms on the reading thread
        out = FilledBytes(n)
        try:
            self.readinto(out.view)  # all n, or HTTPError
        finally:
            release(out.view)
        return out.value()

    def release(self) -> None:
        """Done with this answer: its connection goes back to the pool if the
        whole body was read and the server keeps it open, else it is closed."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._reusable and self._left == 0:
            self._pool.put(self._key, conn)
        else:
            conn.close()


class Connections:
    """Keep-alive connections for GETs; thread-safe (each request has its own
    socket; idle ones wait in a list per address, at most `pool_size`)."""

    def __init__(self, timeout: float, pool_size: int, tls: ssl.SSLContext | None = None):
        self.timeout = timeout
        self.pool_size = max(1, pool_size)
        self._tls = tls
        self._idle: dict[tuple, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self.opened = 0  # connections made, for tests and stats

    def _connect(self, key: tuple) -> socket.socket:
        scheme, host, port = key
        sock = socket.create_connection((host, port), self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if scheme == "https":
                tls = self._tls or ssl.create_default_context()
                sock = tls.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(self.timeout)
        self.opened += 1
        return sock

    def put(self, key: tuple, conn: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.pool_size:
                idle.append(conn)
                return
        conn.close()

    def _take(self, key: tuple) -> socket.socket | None:
        with self._lock:
            idle = self._idle.get(key)
            return idle.pop() if idle else None

    def get(self, scheme: str, host: str, port: int, target: str,
            headers: dict[str, str]) -> Response:
        """Send `GET target` to host:port with `headers` (Host is added) and
        read the answer's head. A connection from the pool that turns out
        closed by the server is replaced by a new one, once."""
        return self.send("GET", scheme, host, port, target, headers)

    def send(self, method: str, scheme: str, host: str, port: int, target: str,
             headers: dict[str, str], body: memoryview | bytes | None = None) -> Response:
        """`get` for any method; `body` (its Content-Length is the caller's
        header) sent after the head, from the caller's buffer, uncopied."""
        key = (scheme, host, port)
        netloc = host if port == (443 if scheme == "https" else 80) else f"{host}:{port}"
        request = "".join([f"{method} {target} HTTP/1.1\r\nHost: {netloc}\r\n",
                           *[f"{k}: {v}\r\n" for k, v in headers.items()], "\r\n"]).encode()
        conn = self._take(key)
        if conn is not None:
            try:
                return self._exchange(key, conn, request, body)
            except (ConnectionError, HTTPError):
                pass  # the server closed it while it was idle: a new connection
        return self._exchange(key, self._connect(key), request, body)

    def _exchange(self, key: tuple, conn: socket.socket, request: bytes,
                  body: memoryview | bytes | None = None) -> Response:
        try:
            conn.sendall(request)
            if body:
                conn.sendall(body)
            head = b""
            while True:
                data = conn.recv(_RECV)
                if not data:
                    raise HTTPError("the connection closed before an answer")
                head += data
                end = head.find(b"\r\n\r\n")
                if end >= 0:
                    break
                if len(head) > _MAX_HEAD:
                    raise HTTPError(f"an answer's head longer than {_MAX_HEAD} bytes")
            lines = head[:end].decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
                raise HTTPError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        except BaseException:
            conn.close()
            raise
        reusable = (version == "HTTP/1.1"
                    and headers.get("connection", "").lower() != "close")
        return Response(int(rest[:3]), headers, conn, head[end + 4:], self, key, reusable)

    def clear(self) -> None:
        """Close the idle connections (a forked child must not share them)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
