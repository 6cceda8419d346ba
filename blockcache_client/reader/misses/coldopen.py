"""Cold directories: a file's version taken from its first block's GET.

A block key carries its file's version (the ETag), so a read must know the
version before it can look in the cache. Where the blocks are not there,
asking for it first (a HEAD, or a listing of the directory from its second
stat on: `metadata`) is a request the read could do without: S3's answer to
the GET of the first block names the ETag, the size (Content-Range) and
Last-Modified, which is all a `FileInfo` holds for an object.

A directory is cold once a file of it had its first block fetched from the
source (`Fetcher` reports it: in no cache, not even the cluster tier's). In
a cold directory, `Volume.open` of a path this process has never seen,
found or missing, sends that one GET (`Backend.read_first`): the FileInfo
goes to the metadata cache, the block to the memory LRU and the daemon as
a miss's does, and to the file object for its first read (the cluster tier
is not asked: the directory's first file was not there). The first file of
a directory not seen yet is stat-ed as before: its read finds the directory
cold or warm. A warm directory, and any path seen before (its blocks were
filled), keep the stat and the listing: one request a directory and no GET.
A GET-opened file whose block is cached already (another process filled it)
makes its directory warm again.

Never mixed bytes: the version and the first block come from one answer, and
the file's other blocks are ranged GETs with If-Match on that ETag (`fetch`):
a rewrite after the open gives ESTALE, never a mix. A 404 (a missing file,
or a directory, which S3 holds no object for) leaves the open to the stat,
which tells them apart; an answer without a version (an empty object's 416)
is followed by the file's own stat, not a listing.
"""

from __future__ import annotations

from collections.abc import Callable

from ...sources.backend import Backend
from ...sources.fileinfo import FileInfo
from ..hits.blockhits import HitReader
from .metadata import META_LIMIT, Metadata

_COLD_LIMIT = META_LIMIT // 64  # cold directories remembered before starting over


class ColdOpens:
    """Which directories are cold, and opening their unseen files by a GET."""

    def __init__(self, meta: Metadata, backend: Backend, block_size: int, hits: HitReader):
        self._meta = meta
        self._backend = backend
        self._block_size = block_size
        self._counters = hits.counters
        self._is_cached = hits.is_cached  # a block file on the cache disk
        self._cold: set[str] = set()

    def found(self, rel: str, cold: bool) -> None:
        """A file of `rel`'s directory was (`cold`) or was not in any cache
        when read: its other files likely the same."""
        parent = rel.rpartition("/")[0]
        if not cold:
            self._cold.discard(parent)
        elif parent not in self._cold:
            if len(self._cold) >= _COLD_LIMIT:
                self._cold.clear()
            self._cold.add(parent)

    def open(self, rel: str, key_prefix: Callable[[str, str], str],
             keep: Callable[[str, bytes], None]) -> tuple[FileInfo, bytes | None] | None:
        """(FileInfo, its first block for the first read, or None if cached)
        of `rel` from one GET, if its directory is cold and the path unseen;
        None for the caller to stat (warm, seen, no object by that name, or
        a backend that cannot tell the version with the bytes).
        `key_prefix(rel, version)`: the version's block key prefix; `keep`:
        where a block from the source goes (the memory LRU, the daemon)."""
        if rel.rpartition("/")[0] not in self._cold or self._meta.seen(rel) \
                or not self._backend.reads_first:
            return None
        try:
            got = self._backend.read_first(rel, self._block_size)
        except FileNotFoundError:
            return None
        if got is None:  # the answer did not tell the version: the file's stat
            try:
                info = self._backend.stat(rel)
            except FileNotFoundError:
                return None
            self._meta.opened(rel, info)
            return None if info.is_dir else (info, None)
        info, data = got
        self._meta.opened(rel, info)
        self._counters.add3("backend_requests", "backend_bytes", len(data), "cold_opens")
        key = key_prefix(rel, info.version) + format(0, "016x")
        if self._is_cached(key):  # filled meanwhile: stat its neighbours again
            self.found(rel, False)
            return info, None
        if data:
            keep(key, data)
        return info, data
