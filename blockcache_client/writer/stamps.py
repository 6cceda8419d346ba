"""This host's word of a write: what a writer here just changed, for this host's other readers.

Another mount of the volume on this host holds its metadata for its TTL:
without word of the write, its next open would read the old version. So
after each change (an upload, an unlink, a rename) the writer puts a
*stamp* in the host cache: a block like any other, keyed by the file's path
and the version string `STAMP` (a NUL: no real version has one) at offset
0, sealed under the volume key (no one without it can forge one), holding
the FileInfo written (or none: removed) and when, padded to `STAMP_BYTES`.
The daemon never overwrites a block, so a stamp is replaced by an evict,
then a put; the daemon writes a put's file in the background, so the change
returns once the new stamp can be read from the cache disk (at most
`VISIBLE_WAIT`). A reader at open
(`fsclient`: an open answered from its metadata cache) reads the stamp of
the path from the cache disk, as a hit (no round trip; an absent stamp
costs a failed open(2)), and asks the source again if the stamp is newer
than its metadata: so an open after the writer's close, on any mount of
this host, sees the new version.

What it does not promise: the daemon may decline the put (a full cache
whose admission prefers the blocks it holds) or evict the stamp later, and
without a daemon there is none; other mounts then see the change after
their TTL, as other hosts do. A TTL of 0 on a directory (`dir_ttl`) makes
every open there ask the source.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from ..contract import blockfile
from ..contract.errors import BlockcacheError
from ..daemonclient.client import Client
from ..sources.fileinfo import FileInfo

log = logging.getLogger(__name__)

STAMP = "\x00written"
STAMP_BYTES = 512
CALL_TIMEOUT = 2.0
VISIBLE_WAIT = 2.0   # seconds a change waits for its stamp to reach the cache disk
VISIBLE_POLL = 0.001
KEYS_KEPT = 1 << 16  # stamp keys of paths kept, before starting over

CachedBlock = Callable[[str, int], "bytes | None"]  # (key, length) -> plaintext if cached


def encode(info: FileInfo | None, when_ns: int) -> bytes:
    """A stamp's plaintext: the FileInfo written (None: removed) and when."""
    body = {"when": when_ns}
    if info is not None:
        body.update(size=info.size, mtime_ns=info.mtime_ns, version=info.version,
                    mode=info.mode)
    raw = json.dumps(body).encode()
    if len(raw) > STAMP_BYTES:
        raise ValueError(f"a stamp of {len(raw)} bytes (a version that long?)")
    return raw.ljust(STAMP_BYTES, b" ")


def decode(rel: str, data: bytes) -> tuple[FileInfo | None, int] | None:
    """(the FileInfo, or None if removed; when) of a stamp's plaintext, or None."""
    try:
        body = json.loads(data)
        when = int(body["when"])
        if "version" not in body:
            return None, when
        return FileInfo(path=rel, name=rel.rpartition("/")[2], size=int(body["size"]),
                        is_dir=False, is_link=False, mtime_ns=int(body["mtime_ns"]),
                        version=str(body["version"]), mode=body.get("mode")), when
    except (ValueError, KeyError, TypeError):
        return None


class Stamps:
    """One volume's stamps in this process: put after each change, read at open."""

    def __init__(self, key_prefix: Callable[[str, str], str], volume_key: bytes,
                 chunk_size: int, socket_path: str, daemon_uid: int | None,
                 cached: CachedBlock):
        self._key_prefix = key_prefix  # (path, version) -> its blocks' key prefix
        self._volume_key = volume_key
        self._chunk_size = chunk_size
        self._client_args = (socket_path, daemon_uid)
        self._cached = cached
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._keys: dict[str, str] = {}  # path -> its stamp's key (an open checks it)

    def key(self, rel: str) -> str:
        key = self._keys.get(rel)
        if key is None:
            if len(self._keys) >= KEYS_KEPT:
                self._keys.clear()
            key = self._keys[rel] = self._key_prefix(rel, STAMP) + format(0, "016x")
        return key

    def known(self, path: str) -> str | None:
        """The stamp key of `path` if it was asked for before as it is
        (canonical, then): an open skips normalizing its path again."""
        return self._keys.get(path)

    def put(self, rel: str, info: FileInfo | None) -> None:
        """Stamp `rel` as changed now (to `info`, or removed). Never raises:
        without a daemon there is no stamp, and other mounts wait for their TTL."""
        key = self.key(rel)
        when = time.time_ns()
        blob = blockfile.seal(key, encode(info, when), self._volume_key, self._chunk_size)
        try:
            with self._lock:
                if self._client is None:
                    self._client = Client(self._client_args[0], timeout=CALL_TIMEOUT,
                                          daemon_uid=self._client_args[1])
                client = self._client
            client.evict(key)
            accepted, reason = client.put(key, blob)
        except BlockcacheError as exc:
            log.debug("no stamp for %s: %s", rel, exc)
            return
        if not accepted:
            log.debug("no stamp for %s: the daemon declined it (%s)", rel, reason)
            return
        deadline = time.monotonic() + VISIBLE_WAIT
        while time.monotonic() < deadline:  # (its write is queued behind the evict)
            found = self.read(rel, key)
            if found is not None and found[1] == when:
                return
            time.sleep(VISIBLE_POLL)
        log.debug("the stamp of %s did not reach the cache disk in %gs", rel, VISIBLE_WAIT)

    def read(self, rel: str, key: str | None = None) -> tuple[FileInfo | None, int] | None:
        """The stamp of `rel` on this host's cache, if there is one."""
        data = self._cached(key or self.key(rel), STAMP_BYTES)
        return decode(rel, data) if data is not None else None

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
