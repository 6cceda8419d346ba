"""The read-only FUSE file system over one `Volume` (pyfuse3, asyncio mode):
the handlers, each a few lines over the parts that hold the mount's state.

- `inodes.InodeTable`: the inodes the kernel knows (stable keyed hashes of
  paths, the numbers block keys use), bounded by the kernel's own inode cache.
- `lookups.Lookups`: FileInfos by TTL from the metadata cache, background
  directory listings, then the volume (asked for fresh answers, `max_age=0`:
  the metadata cache is the one place the TTL is applied). The same TTL is
  the kernel's entry/attr timeout.
- `handles.OpenFiles`: open handles pinned to the version they saw, and the
  read path (whole small files at open, block buffers and readahead for
  sequential readers).
- `xattrs.Xattrs`: per-file cache state, the volume's stats on the root.
- `pool.LoopPool`: volume calls block (remote I/O, cache files), so they run
  on a thread pool; the event loop only dispatches and answers from caches.
- `errors.fuse_op`: every handler turns any exception into an errno, since
  pyfuse3 ends its main loop on any exception other than FUSEError. A file
  deleted remotely while open reads as ESTALE; nothing waits forever on the
  kernel side because every answer comes from a handler that returns.
"""

from __future__ import annotations

import collections
import errno
import itertools
import os
import stat
import sys
from typing import TYPE_CHECKING, Any

import pyfuse3
import pyfuse3.asyncio

from blockcache_client import Volume
from blockcache_client.sources.fileinfo import FileInfo

from . import fuseloop
from .config import MountConfig
from .errors import EioLog, erofs, fuse_op
from .handles import OpenFiles
from .inodes import InodeTable
from .lookups import Lookups
from .metacache import MetaCache, parent_of
from .pool import LoopPool
from .xattrs import XATTR_PREFIX, Xattrs

if TYPE_CHECKING:
    from blockcache_client.common.metrics import Histogram

pyfuse3.asyncio.enable()
fuseloop.install()  # a request already queued is read without a loop round trip

# ops whose first argument is a file or dir handle, not an inode
_HANDLE_OPS = frozenset({"read", "flush", "release", "readdir", "releasedir"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT
# what os.fsdecode/os.fsencode use, for names converted on every lookup
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


class BlockcacheFS(pyfuse3.Operations):
    """pyfuse3 operations of one read-only mount of one volume."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, volume: Volume, cfg: MountConfig):
        super().__init__()
        self.volume = volume
        self.cfg = cfg
        self.pool = LoopPool(cfg.threads)
        self.meta = MetaCache(cfg.ttl, cfg.meta_cache_entries)
        self.nodes = InodeTable(volume)
        self.lookups = Lookups(volume, self.meta, self.pool)
        self.open_files = OpenFiles(volume, cfg, self.pool)
        self.uid, self.gid = os.getuid(), os.getgid()
        self.xattrs = Xattrs(volume, cfg, self.pool, self.uid, self.mount_stats)
        self.dir_handles: dict[int, tuple[FileInfo, ...]] = {}
        self._dir_fh = itertools.count(1)
        self.kept_opens = 0  # opens that let the kernel keep its page cache
        self.ops: collections.Counter = collections.Counter()  # requests per operation
        # handling time per operation (a metrics.Histogram; set when metrics are on)
        self.op_latency: Histogram | None = None
        self.eio_log = EioLog()

    def close(self) -> None:
        self.pool.shutdown()

    def mount_stats(self) -> dict:
        """This mount's own counters (`user.blockcache.stats`, under "fsclient")."""
        files = self.open_files
        return {**self.meta.stats(), "inodes": len(self.nodes), "open_files": len(files),
                "prefetches": files.prefetches, "inline_loads": files.inline_loads,
                "kept_opens": self.kept_opens, "stored_opens": files.stored_opens,
                "ops": dict(self.ops)}

    def path_of_request(self, op: str, args: tuple) -> str:
        """The path a failed request was about, for its log line."""
        first = args[0] if args else None
        if op in _HANDLE_OPS:
            h = self.open_files.get(first)  # type: ignore[arg-type]
            if h is not None:
                return h.path
        elif isinstance(first, int):
            node = self.nodes.get(first)
            if node is not None:
                return node.path
        return repr(args[:2])

    def _attrs(self, info: FileInfo, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()  # (generation 0 and st_nlink 1 already)
        a.st_ino = inode
        ttl = self.meta.ttl(info.path)
        a.entry_timeout = ttl
        a.attr_timeout = ttl
        perm = (info.mode or 0) & 0o7777
        size = info.size or 0
        if info.is_link:
            # lstat of a link: its own length; the kernel follows it by readlink
            a.st_mode = stat.S_IFLNK | 0o777
            if info.target is not None:
                size = len(os.fsencode(info.target))
        elif info.is_dir:
            # st_nlink stays 1 for directories too: "subdirectory count
            # unknown", so find/fts do not skip subdirectories
            a.st_mode = stat.S_IFDIR | (perm or 0o755)
        else:
            a.st_mode = stat.S_IFREG | (perm or 0o644)
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

    # metadata

    @fuse_op()
    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext | None = None):
        parent = self.nodes.path(parent_inode)
        sname = name.decode(_FS_ENCODING, _FS_ERRORS)  # os.fsdecode, minus its type checks
        if sname == ".":
            path = parent
        elif sname == "..":
            path = parent_of(parent)
        else:
            path = f"{parent}/{sname}" if parent else sname
        try:
            info = self.lookups.cached(path) or await self.lookups.from_source(path)
        except pyfuse3.FUSEError as exc:
            ttl = self.meta.ttl(path)
            if exc.errno != errno.ENOENT or ttl <= 0:
                raise
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0  # a negative entry the kernel caches for entry_timeout
            negative.entry_timeout = ttl
            return negative
        inode = self.nodes.remember(path, info.size)
        if inode is None:
            raise pyfuse3.FUSEError(errno.EIO)
        if info.is_dir:
            # the next lookups will most likely be in it: its listing starts
            # now, and they wait for it instead of a remote stat each
            self.lookups.list_in_background(path)
        return self._attrs(info, inode)

    async def forget(self, inode_list) -> None:
        self.ops["forget"] += 1
        self.nodes.forget(inode_list)

    @fuse_op()
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None):
        node = self.nodes.node(inode)
        info = self.lookups.cached(node.path) or await self.lookups.from_source(node.path)
        node.size = info.size
        return self._attrs(info, inode)

    @fuse_op()
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext | None = None):
        target = await self.pool.call(self.volume.readlink, self.nodes.path(inode))
        return os.fsencode(target)

    @fuse_op()
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext | None = None):
        listing = await self.lookups.listing(self.nodes.path(inode))
        fh = next(self._dir_fh)
        # A snapshot: readdir offsets index it, so paging a large directory
        # never repeats or skips an entry even if the listing changes meanwhile.
        self.dir_handles[fh] = listing.entries
        return fh

    @fuse_op()
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self.dir_handles.get(fh)
        if entries is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        for i in range(start_id, len(entries)):
            e = entries[i]
            inode = self.nodes.inode_of(e.path)
            if not self.nodes.shown(inode, e.path):
                continue
            if not pyfuse3.readdir_reply(token, os.fsencode(e.name), self._attrs(e, inode), i + 1):
                break
            # readdirplus: every entry the kernel accepted counts as a lookup
            self.nodes.remember(e.path, e.size, inode)

    async def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    @fuse_op()
    async def statfs(self, ctx: pyfuse3.RequestContext | None = None):
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
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext | None = None):
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        node = self.nodes.node(inode)
        path = node.path
        info = self.lookups.cached(path) or await self.lookups.from_source(path)
        if info.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        keep = self.meta.keep_cache(inode, info)
        self.kept_opens += keep
        fh, keep = self.open_files.open(path, info, inode, node, keep)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    @fuse_op(gone=errno.ESTALE)
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        return await self.open_files.read(fh, off, size)

    async def release(self, fh: int) -> None:
        self.ops["release"] += 1
        h = self.open_files.release(fh)
        if h is not None:
            self.nodes.closed(h.inode, h.node)

    # extended attributes

    @fuse_op()
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None):
        info = await self.lookups.stat(self.nodes.path(inode))
        return self.xattrs.names(inode, info.is_dir)

    @fuse_op()
    async def getxattr(self, inode: int, name: bytes,
                       ctx: pyfuse3.RequestContext | None = None) -> bytes:
        if not name.startswith(XATTR_PREFIX):  # (security.*, system.*: no stat for them)
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        info = await self.lookups.stat(self.nodes.path(inode))
        return await self.xattrs.get(inode, info, name, None if ctx is None else ctx.uid)

    # every write operation: read-only file system

    @erofs
    async def setattr(self, *args: Any): ...

    @erofs
    async def mknod(self, *args: Any): ...

    @erofs
    async def mkdir(self, *args: Any): ...

    @erofs
    async def unlink(self, *args: Any): ...

    @erofs
    async def rmdir(self, *args: Any): ...

    @erofs
    async def symlink(self, *args: Any): ...

    @erofs
    async def rename(self, *args: Any): ...

    @erofs
    async def link(self, *args: Any): ...

    @erofs
    async def write(self, *args: Any): ...

    @erofs
    async def create(self, *args: Any): ...

    @erofs
    async def setxattr(self, *args: Any): ...

    @erofs
    async def removexattr(self, *args: Any): ...
