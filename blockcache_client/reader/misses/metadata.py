"""A volume's metadata cache: stat answers, missing paths and listings, by age.

Entries are kept for `meta_ttl` seconds (or a caller's `max_age`; 0 asks the
source). A missing path is remembered as missing for as long as a found one
would be, and a fresh listing of its parent that does not name it answers
too. The second stat in a directory lists it instead (one request for the
whole directory rather than one per file). Each cache is bounded: past its
limit it starts over, and entries refill on demand. Only canonical paths are
stored, so a path found here needs no `normalize`. With `meta_ttl` 0 nothing
is stored at all: a FUSE mount keeps its metadata in its own per-prefix
caches (`fsclient.metacache`) and asks for fresh answers, so it is held once.
Concurrent identical listings are one request (`SingleFlight`): a cold
directory stat-ed by many threads at once (`prefetch_ahead`'s first files)
is listed once, and every caller gets that listing. A caller asking for a
fresh one (`max_age` 0, or no cache) never joins a listing already running.
"""

from __future__ import annotations

import errno
import logging
import time

from ...sources.backend import Backend
from ...sources.fileinfo import FileInfo
from .singleflight import SingleFlight

log = logging.getLogger(__name__)

META_LIMIT = 1 << 20      # cached stat entries before the cache starts over


class Metadata:
    """Stat and listing answers of one volume in one process (thread-safe:
    every update is one dict operation; a race only costs a request)."""

    def __init__(self, backend: Backend, meta_ttl: float):
        self.backend = backend
        self.meta_ttl = meta_ttl
        self._keeps = meta_ttl > 0  # meta_ttl 0: no cache at all
        self._meta: dict[str, tuple[float, FileInfo]] = {}
        # paths the backend said do not exist (Python's import probes many)
        self._missing: dict[str, tuple[float, str]] = {}
        # (when, entries, their names) of each listed directory
        self._dirs: dict[str, tuple[float, list[FileInfo], frozenset[str]]] = {}
        # backend stats per directory since its last listing, None = not listable
        self._dir_misses: dict[str, int | None] = {}
        self._listings = SingleFlight()  # listings running now, by directory

    def _fresh(self, cache: dict, rel: str, max_age: float | None):
        """(the cached value if young enough else None, now)."""
        ttl = self.meta_ttl if max_age is None else max_age
        hit = cache.get(rel)
        now = time.monotonic()
        if hit is not None and ttl > 0 and now - hit[0] <= ttl:
            return hit[1], now
        return None, now

    def cached(self, rel: str) -> FileInfo | None:
        """`rel`'s FileInfo if held fresh, else None; never asks the source."""
        return self._fresh(self._meta, rel, None)[0]

    def seen(self, rel: str) -> bool:
        """This process has found `rel` or found it missing, at any age (or
        keeps no metadata, and so must ask)."""
        return rel in self._meta or rel in self._missing or not self._keeps

    def opened(self, rel: str, info: FileInfo) -> None:
        """Remember what a file's GET told of it (`coldopen`), as a stat's answer."""
        self._remember(rel, info, time.monotonic())

    def stat(self, rel: str, max_age: float | None = None) -> FileInfo:
        """Info of the normalized path `rel`; FileNotFoundError if missing."""
        hit, now = self._fresh(self._meta, rel, max_age)
        if hit is not None:
            return hit
        why, _ = self._fresh(self._missing, rel, max_age)
        if why is None and rel:
            parent, _, name = rel.rpartition("/")
            listing = self._dirs.get(parent)
            if (listing is not None and self._fresh(self._dirs, parent, max_age)[0] is not None
                    and name not in listing[2]):
                why = f"stat {rel} in {self.backend.source}: not in the listing of its directory"
            elif parent:
                why, _ = self._fresh(self._missing, parent, max_age)  # under a missing dir
        if why is not None:
            raise FileNotFoundError(errno.ENOENT, why)
        if rel and max_age != 0 and self._second_miss_in(rel.rpartition("/")[0]):
            found = self._stat_by_listing(rel, now)
            if found is not None:
                return found
        try:
            info = self.backend.stat(rel)
        except FileNotFoundError as exc:
            self._remember_missing(rel, now, exc.strerror or str(exc))
            raise
        self._remember(rel, info, now)
        return info

    def _second_miss_in(self, parent: str) -> bool:
        """Count a backend stat in `parent`; True from the second one on while
        no fresh listing of it is held. One stat in a directory costs one
        request; a job that stats many (an epoch's first pass, a dataset
        index) gets the whole directory from one listing instead of a
        request per file, like fsclient's lookups."""
        n = self._dir_misses.get(parent, 0)
        if n is None:
            return False  # it could not be listed: stat its paths one by one
        if len(self._dir_misses) >= META_LIMIT // 64:
            self._dir_misses.clear()
        self._dir_misses[parent] = n + 1
        return n + 1 >= 2

    def _stat_by_listing(self, rel: str, now: float) -> FileInfo | None:
        """Answer a stat from a fresh listing of its parent: the entry, or
        FileNotFoundError when the listing does not name it or the parent does
        not exist (both remembered as missing); None when the parent cannot be
        listed otherwise (not a directory, a backend that does not list), for
        the caller to stat the path itself, as it then will for every path
        in that parent."""
        parent = rel.rpartition("/")[0]
        try:
            self.list(parent)
        except FileNotFoundError:
            why = f"stat {rel} in {self.backend.source}: its directory {parent} does not exist"
            self._remember_missing(parent, now, why)
        except (OSError, ValueError) as exc:
            log.debug("listing %r to answer a stat failed (%s); stat instead", parent, exc)
            self._dir_misses[parent] = None
            return None
        else:
            hit = self._meta.get(rel)
            if hit is not None:
                return hit[1]
            why = f"stat {rel} in {self.backend.source}: not in the listing of its directory"
        self._remember_missing(rel, now, why)
        raise FileNotFoundError(errno.ENOENT, why)

    def _remember_missing(self, rel: str, now: float, why: str) -> None:
        if not self._keeps:
            return
        if len(self._missing) >= META_LIMIT:
            self._missing.clear()  # bounded like the positive cache
        self._missing[rel] = (now, why)

    def _remember(self, rel: str, info: FileInfo, now: float) -> None:
        if not self._keeps:
            return
        if len(self._meta) >= META_LIMIT:
            self._meta.clear()  # crude but bounded; entries refill on demand
        self._meta[rel] = (now, info)
        self._missing.pop(rel, None)

    def list(self, rel: str, max_age: float | None = None) -> list[FileInfo]:
        """Entries of the normalized directory `rel` (the cached list itself)."""
        hit, now = self._fresh(self._dirs, rel, max_age)
        if hit is not None:
            return hit
        if max_age == 0 or not self._keeps:
            return self._list_now(rel, now)
        return self._listings.do(rel, lambda: self._list_now(rel, now))[0]

    def _list_now(self, rel: str, now: float) -> list[FileInfo]:
        infos = self.backend.listdir(rel)
        if not self._keeps:
            return infos
        if len(self._dirs) >= META_LIMIT // 64:
            self._dirs.clear()
        self._dirs[rel] = (now, infos, frozenset(info.name for info in infos))
        for info in infos:  # canonical paths only: the backend leaves out the rest
            self._remember(info.path, info, now)
        self._dir_misses.pop(rel, None)
        return infos

    def forget(self, rel: str) -> None:
        """Drop what is known of `rel` (its version changed under a reader)."""
        self._meta.pop(rel, None)

    def changed(self, rel: str, info: FileInfo | None, tree: bool = False) -> None:
        """This process changed `rel` in the source (`writer.writes`): hold
        `info` for it (the version just uploaded), or ask the source next
        time (None); its parent's listing and, with `tree`, whatever was
        known under it (a directory removed or renamed) are dropped."""
        parent = rel.rpartition("/")[0]
        for cache in (self._meta, self._missing, self._dirs):
            cache.pop(rel, None)
            if tree:
                under = rel + "/"
                for path in [p for p in cache if p.startswith(under)]:
                    cache.pop(path, None)
        self._dirs.pop(parent, None)
        self._dir_misses.pop(parent, None)
        if info is not None:
            self._remember(rel, info, time.monotonic())
