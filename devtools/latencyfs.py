"""`latency::` — an fsspec filesystem that delays every request to another one.

Emulates remote storage some milliseconds away (benchmarks, `make demo`):

    fsspec.filesystem("latency", target_protocol="file", delay=0.002)
    fsspec.url_to_fs("latency::file:///data", latency={"delay": 0.002})
    Volume("v", "latency::file:///data", key_file, latency={"delay": 0.002})

Each request pays `delay` seconds before it reaches the target: `info`,
`ls`, `cat_file` (one ranged GET), and every range fetch of a file opened with
`open` (what fsspec's caches use), like an object store where each GET and
HEAD is a round trip. Requests from different threads wait concurrently, as
they would on a network. Read-only: writes are refused.

It counts what it was asked (per process: tests and benchmarks measure a
client with it): `requests` in all, `reads` (`cat_file`s) and the most
requests ever in flight at once, `max_in_flight`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import fsspec
from fsspec.implementations.chained import ChainedFileSystem
from fsspec.spec import AbstractBufferedFile

log = logging.getLogger(__name__)

PROTOCOL = "latency"
DEFAULT_DELAY = 0.002


class LatencyFileSystem(ChainedFileSystem):
    """Wraps `fs` (or `target_protocol` + `target_options`), adding `delay` per request."""

    protocol = PROTOCOL
    cachable = False  # two delays over one target are two filesystems

    def __init__(self, target_protocol: str | None = None, target_options: dict | None = None,
                 fs=None, delay: float = DEFAULT_DELAY, fo: str | None = None, **kwargs):
        super().__init__(**kwargs)
        if fs is None:
            fs = fsspec.filesystem(target_protocol or "file", **(target_options or {}))
        self.fs = fs
        self.delay = float(delay)
        if self.delay < 0:
            raise ValueError(f"latency delay {delay!r} must not be negative")
        self.requests = 0
        self.reads = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _request(self, read: bool = False):
        """One request: counted, in flight from its delay to the target's answer."""
        with self._lock:
            self.requests += 1
            self.reads += read
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay:
                time.sleep(self.delay)
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    @classmethod
    def _strip_protocol(cls, path):
        path = fsspec.utils.stringify_path(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        if not path:  # "latency://" alone: url_to_fs then passes the target's path
            return ""
        return path.rstrip("/") or "/"

    def info(self, path, **kwargs):
        with self._request():
            return self.fs.info(path, **kwargs)

    def ls(self, path, detail=True, **kwargs):
        with self._request():
            return self.fs.ls(path, detail=detail, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        with self._request(read=True):
            return self.fs.cat_file(path, start=start, end=end, **kwargs)

    def invalidate_cache(self, path=None):
        self.fs.invalidate_cache(path)

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None,
              **kwargs):
        if mode != "rb":
            raise PermissionError(f"{PROTOCOL}:: is read-only; cannot open {path} with mode {mode}")
        return LatencyFile(self, path, mode, block_size=block_size or "default",
                           cache_options=cache_options, **kwargs)

    def _rm(self, path):
        raise PermissionError(f"{PROTOCOL}:: is read-only; cannot remove {path}")

    def mkdir(self, path, create_parents=True, **kwargs):
        raise PermissionError(f"{PROTOCOL}:: is read-only; cannot create {path}")


class LatencyFile(AbstractBufferedFile):
    """A read-only file whose every range fetch is one delayed `cat_file`."""

    def _fetch_range(self, start, end):
        return self.fs.cat_file(self.path, start=start, end=end)


fsspec.register_implementation(PROTOCOL, LatencyFileSystem, clobber=True)
