"""Answers to lookups: the metadata cache first, then directory listings
fetched in the background, then the volume.

A lookup that misses lists its directory in the background, and so does one
that finds a directory; lookups there that come while the listing is in
flight wait for it (at most LISTING_WAIT, or the directory's TTL if shorter)
instead of a remote stat each. The volume is asked for fresh answers
(`max_age=0`): the metadata cache is the one place the TTL is applied.
Used on the event loop only.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time

import pyfuse3

from blockcache_client import Volume
from blockcache_client.sources.fileinfo import FileInfo

from .metacache import NEGATIVE, DirListing, MetaCache, TtlLru, parent_of
from .pool import LoopPool

log = logging.getLogger("fsclient.fs")

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

    def __init__(self, volume: Volume, meta: MetaCache, pool: LoopPool):
        self.volume = volume
        self.meta = meta
        self._pool = pool
        # parent dir -> its in-flight background listing, and until when a
        # lookup there may wait for it (`_await_listing`)
        self._tasks: dict[str, tuple[asyncio.Task, float]] = {}
        # dirs listed in the background within their TTL: never listed again
        # sooner, even when the listing was too large to keep or failed
        self._listed = TtlLru(4096)

    def cached(self, path: str) -> FileInfo | None:
        """`path`'s FileInfo from the metadata cache, or None if not cached;
        FUSEError(ENOENT) if cached as missing. Handlers try this first, as
        a cached answer needs no coroutine (`from_source`)."""
        info = self.meta.lookup(path)
        if info is NEGATIVE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return info  # type: ignore[return-value]

    async def stat(self, path: str) -> FileInfo:
        """FileInfo of `path` (cached by TTL); FUSEError(ENOENT) if missing."""
        return self.cached(path) or await self.from_source(path)

    async def from_source(self, path: str) -> FileInfo:
        """`stat` for a path not in the metadata cache: from its directory's
        listing if one is in flight, else from the source."""
        if path:
            parent = parent_of(path)
            running = self._tasks.get(parent)
            if running is None:
                # this lookup starts the listing and does not wait for it (a
                # huge directory's takes many requests): one stat, as before
                self.list_in_background(parent)
            elif await _await_listing(*running):
                cached = self.cached(path)
                if cached is not None:
                    return cached
        try:
            info = await self._pool.call(self.volume.stat, path, max_age=0)
        except FileNotFoundError:
            self.meta.put_negative(path)
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        self.meta.put_attr(info)
        return info

    def list_in_background(self, parent: str) -> None:
        """A lookup missed in `parent`, or found it to be a directory: list it
        in the background (unless it is listed or being listed, its TTL is
        zero, or too many listings run), so the next lookups there are
        answered from the listing instead of one remote stat each (a training
        job opens every file of a directory, in any order)."""
        ttl = self.meta.ttl(parent)
        if (ttl <= 0 or parent in self._tasks or len(self._tasks) >= MAX_LISTING_TASKS
                or self._listed.get(parent) is not None or self.meta.listing(parent) is not None):
            return
        self._listed.put(parent, True, ttl)
        task = asyncio.ensure_future(self.list(parent))
        # waiting is bounded by the TTL too: the listing's answer may be as
        # old as its start, and no answer may be older than the TTL
        wait_until = time.monotonic() + min(LISTING_WAIT, ttl)
        self._tasks[parent] = (task, wait_until)
        task.add_done_callback(lambda t: self._listing_done(parent, t))

    async def listing(self, path: str) -> DirListing:
        """The listing of directory `path`: cached, the one in flight if it
        started recently enough (`ls dir` right after its lookup lists it
        once, not twice), or a new one."""
        listing = self.meta.listing(path)
        running = self._tasks.get(path) if listing is None else None
        if running is not None and time.monotonic() <= running[1]:
            try:
                listing = await asyncio.shield(running[0])
            except Exception:  # (logged by _listing_done): list it here
                listing = None
        if listing is None:
            listing = await self.list(path)
        return listing

    async def list(self, path: str) -> DirListing:
        entries = await self._pool.call(self.volume.listdir, path, max_age=0)
        return self.meta.put_listing(path, entries)

    def _listing_done(self, parent: str, task: asyncio.Task) -> None:
        self._tasks.pop(parent, None)
        if not task.cancelled() and task.exception() is not None:
            log.debug("background listing of %r failed: %s", parent, task.exception())


async def _await_listing(task: asyncio.Task, wait_until: float) -> bool:
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
        await asyncio.wait((task,), timeout=left)
    return task.done()
