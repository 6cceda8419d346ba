"""moto's S3 server whose ranged GETs copy their range only, as real S3's cost does,
and which counts what it sends.

    python -m bench.moto_ranges -H 127.0.0.1 -p PORT     # moto.server's arguments
    curl http://127.0.0.1:PORT/_bench/counters            # {"gets": N, "bytes_out": B}

moto reads a whole object out of its buffer for every GET (`FakeKey.value`)
and slices the range from that copy, so an 8 MiB part of a 1 GiB object costs
a 1 GiB copy, and a client with many parts in flight (the CRT client: tens)
holds that many copies at once. Here an object's bytes are read out once and
kept (immutable) until the object is written again, so each GET costs only
its range's copy. `bench.large_files` uses it for every system alike.

The counters: GET requests answered and the body bytes they sent (what
`bench.large_files` compares with a file's size to say how often readers
fetched it), read at `COUNTERS_PATH` (no bucket name starts with `_`).
"""

from __future__ import annotations

import json
import sys
import threading

import moto.server
from moto.s3.models import FakeKey
from moto.server import main

COUNTERS_PATH = "/_bench/counters"
_plain = FakeKey.value


def _get(self: FakeKey) -> bytes:
    kept = self.__dict__.get("_whole_value")
    if kept is None:
        kept = self.__dict__["_whole_value"] = _plain.fget(self)
    return kept


def _set(self: FakeKey, new_value) -> None:
    self.__dict__.pop("_whole_value", None)
    _plain.fset(self, new_value)


FakeKey.value = property(_get, _set)


class Counters:
    """GETs answered and their body bytes, over the server's request threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gets = 0
        self.bytes_out = 0

    def add(self, gets: int, nbytes: int) -> None:
        with self.lock:
            self.gets += gets
            self.bytes_out += nbytes

    def json(self) -> bytes:
        with self.lock:
            return json.dumps({"gets": self.gets, "bytes_out": self.bytes_out}).encode()


def _counted_body(body, counters: Counters):
    """`body` (a WSGI response iterable) passed on, its bytes counted as sent."""
    try:
        for chunk in body:
            counters.add(0, len(chunk))
            yield chunk
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()


class CountingApplication(moto.server.DomainDispatcherApplication):
    """moto's WSGI application, counting GETs and the bytes they send."""

    counters = Counters()

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO") == COUNTERS_PATH:
            body = self.counters.json()
            start_response("200 OK", [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        body = super().__call__(environ, start_response)
        if environ.get("REQUEST_METHOD") != "GET":
            return body
        self.counters.add(1, 0)
        return _counted_body(body, self.counters)


moto.server.DomainDispatcherApplication = CountingApplication  # what `main` builds

if __name__ == "__main__":
    sys.exit(main())
