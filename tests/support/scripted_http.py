"""A loopback TCP server that answers each request with the next scripted
bytes, as they are, then keeps or closes the connection as scripted.

    with ScriptedHTTP([(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok", True)]) as srv:
        ...  # srv.port; srv.requests: the raw request heads received

For what a well-behaved server never sends: a body cut short, a chunked
answer, a kept-alive connection closed while idle.
"""

from __future__ import annotations

import socket
import threading


class ScriptedHTTP:
    def __init__(self, script: list[tuple[bytes, bool]]):
        """`script`: (raw answer, close the connection after it) per request."""
        self._script = list(script)
        self.requests: list[bytes] = []
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(5)
                head = b""
                while self._script and not self._stop.is_set():
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        break
                    if not data:
                        break
                    head += data
                    if b"\r\n\r\n" not in head:
                        continue
                    self.requests.append(head)
                    head = b""
                    answer, close = self._script.pop(0)
                    conn.sendall(answer)
                    if close:
                        break

    def __enter__(self) -> ScriptedHTTP:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close()
