"""A memcached impostor on 127.0.0.1, for the reader's worst case: a server
(or someone in its place: TLS is optional) that answers `get` with whatever
a test says, as slowly as it says.

    fake = FakeMemcached(answer)   # answer(names) -> iterable of bytes | float
    fake.address                   # "127.0.0.1:PORT", for [cluster] memcached
    fake.gets                      # how many gets it was asked
    fake.close()

Bytes are sent as they are, a float sleeps that many seconds. An answer is
cut off after `limit` seconds or when the client hangs up, so even an endless
one stops by itself. Other commands get polite answers: `add` and `set`
NOT_STORED, `delete` NOT_FOUND, `version` VERSION. The `answer` makers below
are the misbehaviours the tier client must survive.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator

Answer = Callable[[list[str]], Iterable[bytes | float]]


class FakeMemcached:
    def __init__(self, answer: Answer, limit: float = 10.0):
        self.answer = answer  # may be replaced between requests
        self.limit = limit
        self.gets = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="fake-memcached", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._listener.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError), conn, conn.makefile("rb") as f:
            while line := f.readline(8192):
                words = line.split()
                if not words:
                    continue
                if words[0] == b"get":
                    self.gets += 1
                    self._send(conn, self.answer([w.decode() for w in words[1:]]))
                elif words[0] in (b"add", b"set"):
                    f.read(int(words[4]) + 2)
                    conn.sendall(b"NOT_STORED\r\n")
                elif words[0] == b"delete":
                    conn.sendall(b"NOT_FOUND\r\n")
                else:
                    conn.sendall(b"VERSION fake\r\n")

    def _send(self, conn: socket.socket, parts: Iterable[bytes | float]) -> None:
        end = time.monotonic() + self.limit
        for part in parts:
            if time.monotonic() > end or self._closed:
                return
            if isinstance(part, float):
                time.sleep(part)
            else:
                conn.sendall(part)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def value_line(name: str, size: int | str) -> bytes:
    return f"VALUE {name} 0 {size}\r\n".encode()


def slow_value(size: int, every: float = 0.04) -> Answer:
    """The first name's value, of the right `size`, one byte per `every` seconds."""
    def answer(names: list[str]) -> Iterator[bytes | float]:
        yield value_line(names[0], size)
        for _ in range(size):
            yield b"\0"
            yield every
    return answer


def endless_values(size: int) -> Answer:
    """`VALUE` for the first name, of the right `size`, again and again, never `END`."""
    def answer(names: list[str]) -> Iterator[bytes | float]:
        one = value_line(names[0], size) + os.urandom(size) + b"\r\n"
        return itertools.repeat(one)
    return answer


def declared(length: int) -> Answer:
    """A `VALUE` line declaring `length` bytes, then zeros as long as it lasts."""
    def answer(names: list[str]) -> Iterator[bytes | float]:
        yield value_line(names[0], length)
        yield from itertools.repeat(bytes(64 << 10))
    return answer
