"""Answers to lookups: the metadata cache first, then directory listings
fetched in the background, then the volume.

A lookup that misses lists its directory in the background, and so does one
that finds a directory; lookups there that come while the listing is in
flight wait for it (at most LISTING_WAIT, or the directory's TTL if shorter)
instead of a remote stat each. The volume is asked for fresh answers
(`max_age=0`): the metadata cache is the one place the TTL is applied.
Called on the worker threads; listings run on their own small pool.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

from blockcache_client import Volume
from blockcache_client.sources.fileinfo import FileInfo

from .metacache import NEGATIVE, DirListing, MetaCache, TtlLru, parent_of
from .session import FuseError

log = logging.getLogger(__name__)

# Directory listings fetched in the background at once, at most.
MAX_LISTING_TASKS = 16
# A lookup that misses while its directory is being listed waits for that
# listing instead of asking the source about the one name, for at most this
# long after the listing started: a small directory's listing costs about
# one remote round trip, like the stat it saves, and a huge one's (many
# pages) soon stops holding lookups up.
LISTING_WAIT = 0.1


class Lookups:
    """FileInfos and listings of one mount's paths, by TTL."""

    def __init__(self, volume: Volume, meta: MetaCache):
        self.volume = volume
        self.meta = meta
        self._pool = ThreadPoolExecutor(MAX_LISTING_TASKS, thread_name_prefix="fsclient-list")
        # parent dir -> its in-flight background listing, and until when a
        # lookup there may wait for it (`_await_listing`)
        self._tasks: dict[str, tuple[Future, float]] = {}
        self._lock = threading.Lock()
        # dirs listed in the background within their TTL: never listed again
        # sooner, even when the listing was too large to keep or failed
        self._listed = TtlLru(4096)
        # wraps what waits on the source: the session's `blocking`, which
        # hands the worker's channel to another thread meanwhile
        self.blocking: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def cached(self, path: str) -> FileInfo | None:
        """`path`'s FileInfo from the metadata cache, or None if not cached;
        FUSEError(ENOENT) if cached as missing. Handlers try this first, as
        a cached answer needs no coroutine (`from_source`)."""
        info = self.meta.lookup(path)
        if info is NEGATIVE:
            raise FuseError(errno.ENOENT)
        return info  # type: ignore[return-value]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def stat(self, path: str) -> FileInfo:
        """FileInfo of `path` (cached by TTL); FuseError(ENOENT) if missing."""
        return self.cached(path) or self.from_source(path)

    def from_source(self, path: str) -> FileInfo:
        """`stat` for a path not in the metadata cache: from its directory's
        listing if one is in flight, else from the source (a wait)."""
        with self.blocking():
            return self._from_source(path)

    def _from_source(self, path: str) -> FileInfo:
        if path:
            parent = parent_of(path)
            running = self._tasks.get(parent)
            if running is None:
                # this lookup starts the listing and does not wait for it (a
                # huge directory's takes many requests): it stats its one path
                self.list_in_background(parent)
            elif _await_listing(*running):
                cached = self.cached(path)
                if cached is not None:
                    return cached
        since = self.meta.now()  # (its TTL runs from the ask: a stamp after it is newer)
        try:
            info = self.volume.stat(path, max_age=0)
        except FileNotFoundError:
            self.meta.put_negative(path)
            raise FuseError(errno.ENOENT) from None
        self.meta.put_attr(info, since)
        return info

    def list_in_background(self, parent: str) -> None:
        """A lookup missed in `parent`, or found it to be a directory: list it
        in the background (unless it is listed or being listed, its TTL is
        zero, or too many listings run), so the next lookups there are
        answered from the listing instead of one remote stat each (a training
        job opens every file of a directory, in any order)."""
        ttl = self.meta.ttl(parent)
        if ttl <= 0:
            return
        with self._lock:
            if (parent in self._tasks or len(self._tasks) >= MAX_LISTING_TASKS
                    or self._listed.get(parent) is not None
                    or self.meta.listing(parent) is not None):
                return
            self._listed.put(parent, True, ttl)
            try:
                task = self._pool.submit(self.list, parent)
            except RuntimeError:  # shut down: the mount is closing
                return
            # waiting is bounded by the TTL too: the listing's answer may be as
            # old as its start, and no answer may be older than the TTL
            self._tasks[parent] = (task, time.monotonic() + min(LISTING_WAIT, ttl))
        task.add_done_callback(lambda t: self._listing_done(parent, t))

    def listing(self, path: str) -> DirListing:
        """The listing of directory `path`: cached, the one in flight if it
        started recently enough (`ls dir` right after its lookup lists it
        once, not twice), or a new one."""
        listing = self.meta.listing(path)
        if listing is not None:
            return listing
        with self.blocking():
            running = self._tasks.get(path)
            if running is not None and time.monotonic() <= running[1]:
                try:
                    listing = running[0].result()
                except Exception:  # (logged by _listing_done): list it here
                    listing = None
            return listing if listing is not None else self.list(path)

    def list(self, path: str) -> DirListing:
        since = self.meta.now()
        entries = self.volume.listdir(path, max_age=0)
        return self.meta.put_listing(path, entries, since)

    def _listing_done(self, parent: str, task: Future) -> None:
        with self._lock:
            self._tasks.pop(parent, None)
        if not task.cancelled() and task.exception() is not None:
            log.debug("background listing of %r failed: %s", parent, task.exception())


def _await_listing(task: Future, wait_until: float) -> bool:
    """Wait for a listing in flight until `wait_until` (LISTING_WAIT, or the
    directory's TTL if shorter, after it started); True if it finished
    (answered or failed: the caller looks in the cache either way, and asks
    the source if the listing did not say). A lookup that came while the
    listing was under way thus costs no remote request of its own; the
    listing asked the source (max_age=0) after the lookup's time minus that
    bound, so its answer is never older than the TTL."""
    if not task.done():
        left = wait_until - time.monotonic()
        if left <= 0:
            return False
        wait_for((task,), timeout=left)
    return task.done()
