"""The read-only FUSE file system over one `Volume` (pyfuse3, asyncio mode).

Design
- Inode numbers are `Volume.inode(path)`: stable keyed hashes of the path, the same
  numbers the reader puts in block keys, on every host and every restart. The
  inode table (`nodes`) maps them back to paths for the inodes the kernel
  knows: an entry is added by a successful lookup or readdirplus entry and
  dropped when `forget` brings its lookup count to zero, so the table is
  bounded by the kernel's own inode cache. Open files keep their path and
  FileInfo in their handle, so a forget never breaks an open file (and the
  node, whose open count guards the page-cache store, stays until release).
- Metadata comes from `MetaCache` (per-prefix TTL) and otherwise from the
  volume, asked for a fresh answer (`max_age=0`: this cache is the one that
  applies the TTL, so an entry is never older than its TTL). The same TTL is
  the kernel's entry/attr timeout, and zero-TTL prefixes always ask. A
  lookup that misses lists its directory in the background, and so does one
  that finds a directory; lookups there that come while the listing is in
  flight wait for it (at most LISTING_WAIT) instead of a remote stat each.
- `open` pins the FileInfo (the version) it saw; every read of that handle
  reads that version. `keep_cache` is set only when the prefix's TTL > 0 and
  the version equals the one seen at the previous open of the inode, or when
  the open has put the whole file in the page cache itself (`_store`).
- Volume calls block (remote I/O, cache files), so they run on a thread pool;
  the event loop only dispatches and answers from caches, including the
  kernel's: a small file whose cache file is in the page cache is read at
  open on the loop (`Volume.readinto_nowait`, which cannot wait on a disk)
  and, when no other handle of it is open, handed to the kernel's page cache
  before the open answers (`_store`), so its reads need no request.
- Sequential reads of a handle trigger `Volume.prefetch` of the next
  `readahead_blocks` blocks, issued once per block crossed; random reads reset
  the streak and prefetch nothing.
- Every handler turns any exception into an errno: pyfuse3 ends its main
  loop on any exception other than FUSEError, which would kill the mount.
  A file deleted remotely while open reads as ESTALE; nothing waits forever on
  the kernel side because every answer comes from a handler that returns.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import itertools
import json
import logging
import os
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pyfuse3
import pyfuse3.asyncio


from . import fuseloop
from .config import MountConfig
from .metacache import NEGATIVE, DirListing, MetaCache, TtlLru, parent_of

pyfuse3.asyncio.enable()
fuseloop.install()  # a request already queued is read without a loop round trip

log = logging.getLogger(__name__)

ROOT_INODE = pyfuse3.ROOT_INODE
XATTR_PREFIX = "user.blockcache."
XATTR_CACHED = b"user.blockcache.cached_bytes"
XATTR_VERSION = b"user.blockcache.version"
XATTR_INODE = b"user.blockcache.inode"
XATTR_STATS = b"user.blockcache.stats"
# The mount's volume settings as JSON (volume TOML keys), for `fsclient warmup
# --mount`; storage_options (may hold credentials) only for root and the owner.
XATTR_CONFIG = b"user.blockcache.config"
# Reads this close to where the previous one ended still count as sequential:
# the kernel issues its readahead requests concurrently, slightly out of order.
SEQ_SLACK = 512 << 10
# A file up to this size (and within one block) is read whole, starting at
# open, and served from the handle: the read is under way while the open
# answer travels back and the application asks for the bytes, and one volume
# read costs less than the several 128 KiB pieces the kernel asks for. A miss
# fetches the whole block anyway, so this never costs an extra remote request.
WHOLE_FILE_MAX = 1 << 20
# A sequential reader of a larger file reads whole blocks into its handle and
# is served from there (the kernel asks in 128 KiB pieces: one volume read
# and one thread hop per block instead of one per piece). At most two blocks
# per handle, and at most this many bytes over all handles.
BUFFER_BYTES_MAX = 128 << 20
# Directory listings fetched in the background at once, at most.
MAX_LISTING_TASKS = 16
# A lookup that misses while its directory is being listed waits for that
# listing instead of asking the source about the one name, for at most this
# long after the listing started: a small directory's listing costs about
# one remote round trip, like the stat it saves, and a huge one's (many
# pages) soon stops holding lookups up.
LISTING_WAIT = 0.1
# ops whose first argument is a file or dir handle, not an inode
_HANDLE_OPS = frozenset({"read", "flush", "release", "readdir", "releasedir"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT
# what os.fsdecode/os.fsencode use, for names converted on every lookup
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


# Errnos a volume error keeps through the mount: they say something true about
# the file or the request. Anything else (a timeout, a refused connection, a
# remote 5xx after the retry budget) is the remote failing: EIO, as a disk
# error would be, with the real cause logged (issue 7).
_KEPT_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                          errno.ESTALE, errno.EINVAL, errno.ENAMETOOLONG})


def errno_of(exc: BaseException, gone: int = errno.ENOENT) -> int:
    """The errno a volume exception maps to; `gone` for a missing file,
    EIO for every error that is not about the file itself."""
    if isinstance(exc, FileNotFoundError):
        return gone
    if isinstance(exc, PermissionError):
        return errno.EACCES
    if isinstance(exc, OSError) and exc.errno in _KEPT_ERRNOS:
        return exc.errno
    return errno.EIO


def fuse_op(gone: int = errno.ENOENT) -> Callable:
    """Decorate a handler so that it only ever raises FUSEError."""

    def wrap(fn: Callable) -> Callable:
        name = fn.__name__

        @functools.wraps(fn)
        async def handler(self: "BlockcacheFS", *args: Any) -> Any:
            self.ops[name] += 1
            timed = self.op_latency
            start = time.perf_counter() if timed is not None else 0.0
            try:
                return await fn(self, *args)
            except pyfuse3.FUSEError:
                raise
            except OSError as exc:
                code = errno_of(exc, gone)
                if code == errno.EIO:
                    self._warn_eio(name, args, exc)
                else:
                    log.debug("%s%r: %s", name, args[:2], exc)
                raise pyfuse3.FUSEError(code) from None
            except Exception:
                log.exception("%s%r failed; answering EIO", fn.__name__, args[:2])
                raise pyfuse3.FUSEError(errno.EIO) from None
            finally:
                if timed is not None:
                    timed.observe(name, time.perf_counter() - start)
        return handler

    return wrap


def _erofs(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def handler(self: "BlockcacheFS", *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)
    return handler


class Node:
    """An inode the kernel knows: its path, kernel lookup count, the size the
    kernel was last told (attributes of a lookup, getattr or readdirplus
    reply) and how many handles of it are open."""

    __slots__ = ("path", "lookups", "size", "opens")

    def __init__(self, path: str, lookups: int):
        self.path = path
        self.lookups = lookups
        self.size = -1
        self.opens = 0


class Handle:
    """An open file: the pinned FileInfo and the sequential-read state."""

    __slots__ = ("path", "info", "node", "inode", "next_off", "streak", "prefetched_until",
                 "data", "pending", "blocks")

    def __init__(self, path: str, info: Any, inode: int, node: Node):
        self.path = path
        self.info = info
        self.inode = inode
        self.node = node  # its open count includes this handle until release
        self.data: memoryview | None = None  # the whole (small) file, once read
        self.pending: asyncio.Future | None = None  # ... while it is being read
        # block offset -> its bytes, for a sequential reader (made at its first
        # block: most handles are small files and never need one)
        self.blocks: dict[int, asyncio.Future] | None = None
        self.next_off = -1
        self.streak = 0
        self.prefetched_until = 0


class BlockcacheFS(pyfuse3.Operations):
    """pyfuse3 operations of one read-only mount of one volume."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, volume: Any, cfg: MountConfig):
        super().__init__()
        self.volume = volume
        self.cfg = cfg
        self.meta = MetaCache(cfg.ttl, cfg.meta_cache_entries)
        self.nodes: dict[int, Node] = {ROOT_INODE: Node("", 1)}
        self.handles: dict[int, Handle] = {}
        self.dir_handles: dict[int, tuple] = {}
        self._fh = itertools.count(1)
        self.pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="fsclient-io")
        self.uid, self.gid = os.getuid(), os.getgid()
        self.prefetches = 0
        self.inline_loads = 0  # whole-file reads served on the loop (no thread hop)
        self.kept_opens = 0  # opens that let the kernel keep its page cache
        self.stored_opens = 0  # opens that put the file's bytes in the page cache
        # put small files' bytes in the kernel's page cache at open (`_store`);
        # set by the mount once its FUSE session exists (never without one)
        self.store_pages = False
        self.ops: collections.Counter = collections.Counter()  # requests per operation
        # handling time per operation (a metrics.Histogram; set when metrics are on)
        self.op_latency: Any = None
        self.whole_file_max = min(WHOLE_FILE_MAX, cfg.block_size)
        # a small file put in the kernel's page cache at its open is read into
        # this one buffer: its bytes are copied into the kernel before the open
        # returns, and nothing keeps a view of it after (no fresh, zeroed
        # buffer per file)
        self._spare = memoryview(bytearray(self.whole_file_max))
        self.buffered_blocks = 0
        self.max_buffered_blocks = max(2, BUFFER_BYTES_MAX // cfg.block_size)
        # parent dir -> its in-flight background listing, and until when a
        # lookup there may wait for it (`_await_listing`)
        self._listing_tasks: dict[str, tuple[asyncio.Task, float]] = {}
        # dirs listed in the background within their TTL: never listed again
        # sooner, even when the listing was too large to keep or failed
        self._listed = TtlLru(4096)
        self._eio_logged: set[str] = set()  # files whose EIO cause was logged

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _warn_eio(self, op: str, args: tuple, exc: OSError) -> None:
        """Log the real cause of an EIO answer, once per file (a failing remote
        would otherwise log every 128 KiB read of every file)."""
        first = args[0] if args else None
        by_handle = op in _HANDLE_OPS
        h = self.handles.get(first) if by_handle else None
        node = self.nodes.get(first) if not by_handle and isinstance(first, int) else None
        path = h.path if h is not None else node.path if node is not None else repr(args[:2])
        if path in self._eio_logged:
            log.debug("%s %s: %s (answering EIO)", op, path, exc)
            return
        if len(self._eio_logged) >= 4096:
            self._eio_logged.clear()  # bounded; a file may then be logged again
        self._eio_logged.add(path)
        log.warning("%s %s failed (%s); answering EIO", op, path or "/", exc)

    # helpers

    def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> "asyncio.Future":
        """Run a blocking call on the pool; its result as an asyncio future.
        One hop there and one `call_soon_threadsafe` back, nothing else: no
        concurrent Future chained to this one (run_in_executor's extra locks
        and callbacks cost the read path a measurable share of its CPU)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, result, None)
        try:
            self.pool.submit(run)
        except RuntimeError as exc:  # the pool is shut down: the mount is closing
            fut.set_exception(OSError(errno.EIO, f"file system is closing: {exc}"))
        return fut

    def _load(self, path: str, off: int, size: int, info: Any,
              buf: bytearray | None = None) -> memoryview:
        """[off, off+size) of `path` (pinned to `info`) as a view of `buf` (a
        fresh buffer if None), on a pool thread: cached blocks decrypt straight
        into it, and replies to the kernel are slices of it, so the bytes are
        copied once from the cache file and once to the kernel, nothing more."""
        if buf is None:
            buf = bytearray(size)
        n = self.volume.readinto(path, off, buf, info=info)
        return memoryview(buf)[:n]

    def _load_nowait(self, path: str, info: Any, buf: bytearray | memoryview) -> memoryview | None:
        """The whole (small) file read here on the event loop, when the
        volume can do it without waiting: its block in the memory LRU, or its
        cache file's path and pages in the kernel's caches (`readinto_nowait`).
        A warm hit then costs no thread hop at all (two hops and the GIL
        handoffs around them cost several times the read itself); anything
        else returns None and goes to the pool, so a slow or hung cache disk
        still never blocks the loop. `buf` (info.size bytes) is left for
        the pool's read when this returns None."""
        try:
            n = self.volume.readinto_nowait(path, 0, buf, info=info)
        except Exception as exc:  # the pool's read reports real errors
            log.debug("inline read of %s: %s", path, exc)
            return None
        if n is None:
            return None
        self.inline_loads += 1
        return memoryview(buf)[:n]

    def _node(self, inode: int) -> Node:
        node = self.nodes.get(inode)
        if node is None:
            # The kernel asked about an inode it forgot: never expected, but an
            # errno is better than a crash.
            raise pyfuse3.FUSEError(errno.ESTALE)
        return node

    def _path(self, inode: int) -> str:
        return self._node(inode).path

    def _from_cache(self, path: str) -> Any:
        """`path`'s FileInfo from the metadata cache, or None if not cached;
        FUSEError(ENOENT) if cached as missing. Handlers try this first, as
        a cached answer needs no coroutine (`_stat_source`)."""
        info = self.meta.lookup(path)
        if info is NEGATIVE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return info

    async def _stat(self, path: str) -> Any:
        """FileInfo of `path` (cached by TTL); FUSEError(ENOENT) if missing."""
        return self._from_cache(path) or await self._stat_source(path)

    async def _stat_source(self, path: str) -> Any:
        """`_stat` for a path not in the metadata cache: from its directory's
        listing if one is in flight, else from the source."""
        if path:
            parent = parent_of(path)
            running = self._listing_tasks.get(parent)
            if running is None:
                # this lookup starts the listing and does not wait for it (a
                # huge directory's takes many requests): one stat, as before
                self._list_in_background(parent)
            elif await self._await_listing(*running):
                cached = self._from_cache(path)
                if cached is not None:
                    return cached
        try:
            info = await self._call(self.volume.stat, path, max_age=0)
        except FileNotFoundError:
            self.meta.put_negative(path)
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        self.meta.put_attr(info)
        return info

    def _list_in_background(self, parent: str) -> None:
        """A lookup missed in `parent`, or found it to be a directory: list it
        in the background (unless it is listed or being listed, its TTL is
        zero, or too many listings run), so the next lookups there are
        answered from the listing instead of one remote stat each (a training
        job opens every file of a directory, in any order)."""
        ttl = self.meta.ttl(parent)
        if (ttl <= 0 or parent in self._listing_tasks or len(self._listing_tasks) >= MAX_LISTING_TASKS
                or self._listed.get(parent) is not None or self.meta.listing(parent) is not None):
            return
        self._listed.put(parent, True, ttl)
        task = asyncio.ensure_future(self._list(parent))
        # waiting is bounded by the TTL too: the listing's answer may be as
        # old as its start, and no answer may be older than the TTL
        wait_until = time.monotonic() + min(LISTING_WAIT, ttl)
        self._listing_tasks[parent] = (task, wait_until)
        task.add_done_callback(lambda t: self._listing_done(parent, t))

    async def _await_listing(self, task: "asyncio.Task", wait_until: float) -> bool:
        """Wait for a listing in flight until `wait_until` (LISTING_WAIT, or
        the directory's TTL if shorter, after it started); True if it
        finished (answered or failed: the caller looks in the cache either
        way, and asks the source if the listing did not say). A lookup that
        came while the listing was under way thus costs no remote request of
        its own; the listing asked the source (max_age=0) after the lookup's
        time minus that bound, so its answer is never older than the TTL."""
        if not task.done():
            left = wait_until - time.monotonic()
            if left <= 0:
                return False
            await asyncio.wait((task,), timeout=left)
        return task.done()

    async def _list(self, path: str) -> DirListing:
        entries = await self._call(self.volume.listdir, path, max_age=0)
        return self.meta.put_listing(path, entries)

    def _listing_done(self, parent: str, task: "asyncio.Task") -> None:
        self._listing_tasks.pop(parent, None)
        if not task.cancelled() and task.exception() is not None:
            log.debug("background listing of %r failed: %s", parent, task.exception())

    def _attrs(self, info: Any, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()  # (generation 0 and st_nlink 1 already)
        a.st_ino = inode
        ttl = self.meta.ttl(info.path)
        a.entry_timeout = ttl
        a.attr_timeout = ttl
        perm = (info.mode or 0) & 0o7777
        if info.is_dir:
            # st_nlink stays 1 for directories too: "subdirectory count
            # unknown", so find/fts do not skip subdirectories
            a.st_mode = stat.S_IFDIR | (perm or 0o755)
        elif info.is_link:
            a.st_mode = stat.S_IFLNK | 0o777
        else:
            a.st_mode = stat.S_IFREG | (perm or 0o644)
        size = info.size or 0
        a.st_size = size
        a.st_blksize = 128 << 10
        a.st_blocks = (size + 511) // 512
        a.st_uid = self.uid
        a.st_gid = self.gid
        mtime = info.mtime_ns or 0
        a.st_mtime_ns = mtime
        a.st_ctime_ns = mtime
        a.st_atime_ns = mtime
        return a

    def _inode(self, path: str) -> int:
        """`Volume.inode(path)` of a path built here from normalized parts
        (a known path and a name from the kernel or a listing): the same
        number without normalizing the path again. A name normalize would
        refuse still goes through it, and raises as before."""
        if "\\" in path or "\0" in path:
            return self.volume.inode(path)
        return self.volume.names.inode(path)

    def _remember(self, path: str, size: int, inode: int | None = None) -> int | None:
        """Inode of `path` (or `inode`, already computed), with its kernel
        lookup count raised by one and `size` noted as the size the kernel
        now has; None on an inode-hash collision (the entry is then not shown)."""
        if inode is None:
            inode = self._inode(path)
        node = self.nodes.get(inode)
        if node is None:
            node = self.nodes[inode] = Node(path, 1)
        elif node.path != path:
            log.error("inode collision: %r and %r both hash to inode %d; %r is hidden",
                      node.path, path, inode, path)
            return None
        else:
            node.lookups += 1
        node.size = size
        return inode

    # metadata

    @fuse_op()
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None):
        parent = self._path(parent_inode)
        sname = name.decode(_FS_ENCODING, _FS_ERRORS)  # os.fsdecode, minus its type checks
        if sname == ".":
            path = parent
        elif sname == "..":
            path = parent_of(parent)
        else:
            path = f"{parent}/{sname}" if parent else sname
        try:
            info = self._from_cache(path) or await self._stat_source(path)
        except pyfuse3.FUSEError as exc:
            ttl = self.meta.ttl(path)
            if exc.errno != errno.ENOENT or ttl <= 0:
                raise
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0  # a negative entry the kernel caches for entry_timeout
            negative.entry_timeout = ttl
            return negative
        inode = self._remember(path, info.size)
        if inode is None:
            raise pyfuse3.FUSEError(errno.EIO)
        if info.is_dir:
            # the next lookups will most likely be in it: its listing starts
            # now, and they wait for it instead of a remote stat each
            self._list_in_background(path)
        return self._attrs(info, inode)

    async def forget(self, inode_list) -> None:
        self.ops["forget"] += 1
        for inode, nlookup in inode_list:
            node = self.nodes.get(inode)
            if node is None or inode == ROOT_INODE:
                continue
            node.lookups -= nlookup
            if node.lookups <= 0 and node.opens <= 0:  # (an open node goes at its release)
                del self.nodes[inode]

    @fuse_op()
    async def getattr(self, inode: int, ctx: Any = None):
        node = self._node(inode)
        info = self._from_cache(node.path) or await self._stat_source(node.path)
        node.size = info.size
        return self._attrs(info, inode)

    @fuse_op()
    async def readlink(self, inode: int, ctx: Any = None):
        target = await self._call(self.volume.readlink, self._path(inode))
        return os.fsencode(target)

    @fuse_op()
    async def opendir(self, inode: int, ctx: Any = None):
        path = self._path(inode)
        listing = self.meta.listing(path)
        running = self._listing_tasks.get(path) if listing is None else None
        if running is not None and time.monotonic() <= running[1]:
            # being listed (its lookup started it): that answer, not a second
            # listing; it is as fresh as a lookup waiting for it would get
            try:
                listing = await asyncio.shield(running[0])
            except Exception:  # (logged by _listing_done): list it here
                listing = None
        if listing is None:
            listing = await self._list(path)
        fh = next(self._fh)
        # A snapshot: readdir offsets index it, so paging a large directory
        # never repeats or skips an entry even if the listing changes meanwhile.
        self.dir_handles[fh] = listing.entries
        return fh

    @fuse_op()
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        entries = self.dir_handles.get(fh)
        if entries is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        for i in range(start_id, len(entries)):
            e = entries[i]
            inode = self._inode(e.path)
            node = self.nodes.get(inode)
            if node is not None and node.path != e.path:
                log.error("inode collision: %r and %r both hash to inode %d; %r is hidden",
                          node.path, e.path, inode, e.path)
                continue
            if not pyfuse3.readdir_reply(token, os.fsencode(e.name), self._attrs(e, inode), i + 1):
                break
            # readdirplus: every entry the kernel accepted counts as a lookup
            self._remember(e.path, e.size, inode)

    async def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    @fuse_op()
    async def statfs(self, ctx: Any = None):
        s = pyfuse3.StatvfsData()
        s.f_bsize = self.cfg.block_size
        s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = 0
        s.f_files = len(self.nodes)
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # data

    @fuse_op()
    async def open(self, inode: int, flags: int, ctx: Any = None):
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        node = self._node(inode)
        path = node.path
        info = self._from_cache(path) or await self._stat_source(path)
        if info.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        keep = self.meta.keep_cache(inode, info)
        self.kept_opens += keep
        fh = next(self._fh)
        h = self.handles[fh] = Handle(path, info, inode, node)
        node.opens += 1
        if 0 < info.size <= self.whole_file_max and not keep:
            # Safe to put in the page cache (see _store): read into the spare
            # buffer, whose bytes the kernel copies before this call returns.
            storable = self.store_pages and node.opens == 1 and node.size == info.size
            buf = self._spare[:info.size] if storable else bytearray(info.size)
            data = self._load_nowait(path, info, buf)
            if data is None:
                if storable:
                    buf = bytearray(info.size)  # the pool's read outlives this call
                h.pending = self._call(self._load, path, 0, info.size, info, buf)
                h.pending.add_done_callback(_retrieve)
            elif storable and self._store(inode, data):
                keep = True  # (keep_cache=False would drop the pages just stored)
            else:
                h.data = memoryview(bytes(data)) if storable else data
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    def _store(self, inode: int, data: memoryview) -> bool:
        """Put a whole small file, read at its open, into the kernel's page
        cache for `inode` (FUSE notify_store), so the reader's reads are
        answered there, without a read request. True if stored: the open
        must then answer keep_cache, or the kernel drops the pages.

        The caller guarantees it is safe: no other handle of the inode is
        open (the kernel locks a page while a read of it waits for this
        process, and the store waits for that lock: a store during such a
        read would never return), and the kernel's size of the inode is this
        version's (every page it may serve, [0, size), now holds these
        bytes, so keeping them serves this version and nothing else); and
        that `store_pages` is still on."""
        try:
            pyfuse3.notify_store(inode, 0, data)
        except OSError as exc:
            # failed, perhaps part way: this open answers without keep_cache,
            # so the kernel drops whatever was stored. Only a kernel without
            # the call turns it off; anything else (ENOMEM) is this file's
            if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP):
                self.store_pages = False
                log.info("cannot put file data in the kernel's page cache (%s); small files "
                         "are read through read requests", exc)
            else:
                log.debug("notify_store of inode %d failed: %s", inode, exc)
            return False
        self.stored_opens += 1
        return True

    @fuse_op(gone=errno.ESTALE)
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        h = self.handles.get(fh)
        if h is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        avail = h.info.size - off
        if avail <= 0 or size <= 0:
            return b""
        size = min(size, avail)
        if h.data is None and h.pending is not None:
            pending = h.pending  # concurrent reads all wait for the one whole-file read
            try:
                h.data = await pending
            finally:
                if h.pending is pending:
                    h.pending = None  # done (or failed: the next read tries again)
        if h.data is None and h.info.size <= self.whole_file_max:
            # a kept open whose pages the kernel partly lost: the same inline try
            buf = bytearray(h.info.size)
            h.data = self._load_nowait(h.path, h.info, buf)
            if h.data is None:
                h.data = await self._call(self._load, h.path, 0, h.info.size, h.info, buf)
        if h.data is not None:
            return h.data[off:off + size]
        sequential = self._follow(h, off, size)
        if (h.blocks is not None and (off - off % self.cfg.block_size) in h.blocks) or (
                sequential and self.buffered_blocks < self.max_buffered_blocks):
            return await self._read_blocks(h, off, size)
        return await self._call(self._load, h.path, off, size, h.info)

    async def _read_blocks(self, h: Handle, off: int, size: int) -> bytes | memoryview:
        """Serve [off, off+size) from whole blocks read into the handle."""
        bs = self.cfg.block_size
        blocks = h.blocks
        if blocks is None:
            blocks = h.blocks = {}
        out = []
        while size > 0:
            boff = off - off % bs
            fut = blocks.get(boff)
            if fut is None:
                fut = self._call(self._load, h.path, boff, min(bs, h.info.size - boff), h.info)
                fut.add_done_callback(_retrieve)
                blocks[boff] = fut
                self.buffered_blocks += 1
                if len(blocks) > 2:
                    del blocks[next(iter(blocks))]
                    self.buffered_blocks -= 1
            try:
                data = await fut
            except BaseException:
                if blocks.get(boff) is fut:  # let the next read try again
                    del blocks[boff]
                    self.buffered_blocks -= 1
                raise
            piece = data[off - boff:off - boff + size]
            if not piece:
                break
            out.append(piece)
            off += len(piece)
            size -= len(piece)
        return out[0] if len(out) == 1 else b"".join(out)

    def _follow(self, h: Handle, off: int, size: int) -> bool:
        """Track the handle's read pattern; True if this read continues a
        sequential run. Sequential runs also prefetch the next blocks."""
        if h.next_off >= 0 and abs(off - h.next_off) <= SEQ_SLACK:
            h.streak += 1
        else:
            h.streak = 0
            h.prefetched_until = 0
        h.next_off = off + size
        if h.streak < 1:
            return False
        if self.cfg.readahead_blocks:
            self._readahead(h, off)
        return True

    def _readahead(self, h: Handle, off: int) -> None:
        bs = self.cfg.block_size
        first = (off // bs + 1) * bs
        end = min(h.info.size, first + self.cfg.readahead_blocks * bs)
        start = max(first, h.prefetched_until)
        if start >= end:
            return
        h.prefetched_until = end
        self.prefetches += 1
        fut = self._call(self.volume.prefetch, h.path, start, end - start, info=h.info)
        fut.add_done_callback(_log_prefetch_failure)

    async def release(self, fh: int) -> None:
        self.ops["release"] += 1
        h = self.handles.pop(fh, None)
        if h is not None:
            if h.blocks:
                self.buffered_blocks -= len(h.blocks)
            node = h.node
            node.opens -= 1
            if node.opens <= 0 and node.lookups <= 0 and self.nodes.get(h.inode) is node:
                del self.nodes[h.inode]  # forgotten while open

    # extended attributes: per-file cache state, and the volume's stats on the root

    def _xattr_names(self, inode: int, is_dir: bool) -> list[bytes]:
        names = [XATTR_INODE] if is_dir else [XATTR_CACHED, XATTR_VERSION, XATTR_INODE]
        if inode == ROOT_INODE:
            names += [XATTR_STATS, XATTR_CONFIG]
        return names

    @fuse_op()
    async def listxattr(self, inode: int, ctx: Any = None):
        info = await self._stat(self._path(inode))
        return self._xattr_names(inode, info.is_dir)

    @fuse_op()
    async def getxattr(self, inode: int, name: bytes, ctx: Any = None) -> bytes:
        if not name.startswith(XATTR_PREFIX.encode()):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        path = self._path(inode)
        info = await self._stat(path)
        if name not in self._xattr_names(inode, info.is_dir):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        if name == XATTR_CACHED:
            return str(await self._call(self.volume.cached_bytes, path, info=info)).encode()
        if name == XATTR_VERSION:
            return str(info.version).encode("utf-8", "surrogateescape")
        if name == XATTR_INODE:
            return str(inode).encode()
        if name == XATTR_CONFIG:
            return self._config_json(ctx is None or ctx.uid in (0, self.uid))
        stats = dict(await self._call(self.volume.stats))
        stats["fsclient"] = {**self.meta.stats(), "inodes": len(self.nodes),
                             "open_files": len(self.handles), "prefetches": self.prefetches,
                             "inline_loads": self.inline_loads, "kept_opens": self.kept_opens,
                             "stored_opens": self.stored_opens,
                             "ops": dict(self.ops)}
        return json.dumps(stats, sort_keys=True, default=str).encode()

    def _config_json(self, with_storage_options: bool) -> bytes:
        c = self.cfg
        out: dict[str, Any] = {"volume": c.volume, "source": c.source, "key_file": c.key_file,
                               "block_size": c.block_size, "fill_queue": c.fill_queue_bytes,
                               "memory_cache": c.memory_cache_bytes}
        if c.socket:
            out["socket"] = c.socket
        if with_storage_options:
            out["storage_options"] = dict(c.storage_options)
        elif c.storage_options:
            out["storage_options_hidden"] = True
        return json.dumps(out, sort_keys=True, default=str).encode()

    # every write operation: read-only file system

    @_erofs
    async def setattr(self, *args: Any): ...

    @_erofs
    async def mknod(self, *args: Any): ...

    @_erofs
    async def mkdir(self, *args: Any): ...

    @_erofs
    async def unlink(self, *args: Any): ...

    @_erofs
    async def rmdir(self, *args: Any): ...

    @_erofs
    async def symlink(self, *args: Any): ...

    @_erofs
    async def rename(self, *args: Any): ...

    @_erofs
    async def link(self, *args: Any): ...

    @_erofs
    async def write(self, *args: Any): ...

    @_erofs
    async def create(self, *args: Any): ...

    @_erofs
    async def setxattr(self, *args: Any): ...

    @_erofs
    async def removexattr(self, *args: Any): ...


def _settle(fut: "asyncio.Future", result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():  # the handler waiting for it was cancelled (interrupt)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _retrieve(fut: "asyncio.Future") -> None:
    # A whole-file read nobody awaited (the file was closed unread) must not
    # log "exception never retrieved"; the read that awaits it reports errors.
    if not fut.cancelled():
        fut.exception()


def _log_prefetch_failure(fut: "asyncio.Future") -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.debug("prefetch failed (reads are unaffected): %s", exc)
