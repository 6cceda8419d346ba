"""The file system over one `Volume`: the handlers the FUSE session
(`session.Session`) calls, each a few lines over the parts that hold the mount's
state. Every handler runs on the worker thread that read its request. A
mount is read-only unless it is writable (`--writable`): then the write
handlers of `fswrites` serve too, over `writefiles.WriteFiles`.

- `inodes.InodeTable`: the inodes the kernel knows (stable keyed hashes of
  paths, the numbers block keys use), at most `max_nodes`: past that
  `pruner.NodePruner` asks the kernel to forget the least recently used.
- `lookups.Lookups`: FileInfos by TTL from the metadata cache, background
  directory listings, then the volume (asked for fresh answers, `max_age=0`:
  the metadata cache is the one place the TTL is applied). The same TTL is
  the kernel's entry/attr timeout.
- `handles.OpenFiles`: open handles pinned to the version they saw, and the
  read path (whole small files, block buffers for sequential readers, the
  reader's chunk cache for random reads).
- `xattrs.Xattrs`: per-file cache state, the volume's stats on the root.
- `errors.fuse_op`: every handler turns any exception into an errno, logging
  the cause of an EIO once per file. A file deleted remotely while open reads
  as ESTALE.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import sys
from collections.abc import Callable, Iterable
from typing import Any

from blockcache_client import Volume
from blockcache_client.sources.fileinfo import FileInfo

from .config import MountConfig
from .errors import EioLog, fuse_op
from .fswrites import WriteHandlers
from .handleids import HandleNumbers, is_write_handle, listing_tag, tag_of
from .handles import OpenFiles
from .inodes import InodeTable
from .lookups import Lookups
from .memory import bound, rss_bytes
from .metacache import MetaCache, parent_of
from .pruner import NodePruner, saved_cap
from .session import Attributes, DirReply, FuseError
from .session.structs import pack_statfs
from .writefiles import WriteFiles
from .xattrs import ENOATTR, XATTR_PREFIX, Xattrs

log = logging.getLogger(__name__)

# ops whose first argument is a file or dir handle, not an inode
_HANDLE_OPS = frozenset({"read", "release", "readdir", "releasedir"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT
# what os.fsdecode/os.fsencode use, for names converted on every lookup
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


class BlockcacheFS(WriteHandlers):
    """The handlers of one mount of one volume (`session.Operations`)."""

    def __init__(self, volume: Volume, cfg: MountConfig):
        self.volume = volume
        self.cfg = cfg
        self.meta = MetaCache(cfg.ttl, cfg.meta_cache_entries)
        self.nodes = InodeTable(volume)
        self.pruner = NodePruner(self.nodes, cfg.max_nodes)  # (the kernel forgets past the cap)
        self.lookups = Lookups(volume, self.meta)
        self.open_files = OpenFiles(volume, cfg, self.nodes)
        self.writes = WriteFiles(volume) if cfg.writable else None  # (None: read-only)
        self.nodes.resized = self.open_files.pages.raise_generation
        self.uid, self.gid = os.getuid(), os.getgid()
        # a writable mount any uid may write: modes that say so (default_permissions)
        self.open_modes = (0o666, 0o777) if cfg.writable and cfg.write_access == "all" \
            else (0, 0)
        self.xattrs = Xattrs(volume, cfg, self.uid, self.mount_stats)
        self.dir_handles: dict[int, tuple[FileInfo, ...]] = {}
        self._dir_fh = HandleNumbers()  # numbers that name the snapshot (see handleids)
        self.dirs_adopted = 0  # directory handles opened before this server, listed again
        # the keeper that handed this server the connection (its pid, as it
        # said): the mount vouches for it to askers of another uid (`control`)
        self.keeper = 0
        # requests per operation and workers busy: the session's, once it runs
        self.op_counts: Callable[[], dict[str, int]] = dict
        self.handoffs: Callable[[], int] = int  # waits handed off with their thread
        self.fuse_minor: Callable[[], int | None] = lambda: None  # the minor agreed at INIT
        self.eio_log = EioLog()
        # drops the kernel's attributes of a node (the session's, once it runs)
        self.inval_attrs: Callable[[int], None] = lambda inode: None
        self.blocking: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def close(self) -> None:
        self.pruner.stop()
        self.open_files.pages.stop()
        self.lookups.close()

    def attach(self, session: Any) -> None:
        """Count the session's requests in the stats, and wrap every wait
        (the source, a listing, a cache miss, a disk read) in its `blocking`,
        which hands the worker's channel on."""
        self.op_counts = session.op_counts
        self.handoffs = lambda: session.handoffs
        self.fuse_minor = lambda: session.terms.minor if session.terms is not None else None
        self.blocking = self.lookups.blocking = self.open_files.blocking = session.blocking
        self.inval_attrs = session.notify_inval_attrs
        # (also after a takeover: handles opened before it never store, see pagestore)
        saved = self.nodes.saved
        pages = self.open_files.pages
        if saved is not None:  # (a store of the server before may still land)
            pages.await_predecessors(saved.fd)
            pages.connect(session.notify_fd, saved.fd)
            if self.cfg.store_pages:
                pages.enable(session.notify_fd, saved.fd)
            # (its notifications, too, are written by the page store's child)
            self.pruner.attach(pages.notify, lambda: session.terms.minor if session.terms else 0,
                               session.blocking, lambda: bool(session.workers))
        pages.blocking = session.blocking

    def mount_stats(self) -> dict:
        """This mount's own counters (`user.blockcache.stats`, under "fsclient")."""
        files = self.open_files
        return {**self.meta.stats(), "inodes": len(self.nodes), "open_files": len(files),
                "open_write_files": len(self.writes) if self.writes is not None else 0,
                **self._bound_stats(),
                "prefetches": files.prefetches, "inline_loads": files.inline_loads,
                "kept_opens": files.kept_opens, "stored_opens": files.stored_opens,
                "stale_answers": files.stale_answers,
                "stored_pages": files.pages.stored_pages, "stores_skipped": files.pages.skipped,
                "nodes_recovered": self.nodes.recovered, **self._saved_stats(),
                "handles_recovered": files.adopted + self.dirs_adopted,
                "ops": self.op_counts(), "waits_handed_off": self.handoffs(),
                "keeper": self.keeper, "fuse_minor": self.fuse_minor()}

    def _saved_stats(self) -> dict:
        saved = self.nodes.saved
        if saved is None:
            return {}
        return {"saved_nodes": len(saved.paths), "saved_bytes": saved.size(),
                "saved_cap_bytes": saved_cap(self.cfg.max_nodes),
                "saved_compactions": saved.compactions}

    def _bound_stats(self) -> dict:
        """The server's memory and what bounds it (fsclient/DESIGN.md)."""
        pruner = self.pruner
        return {"server_rss_bytes": rss_bytes(),
                "server_rss_bound_bytes": bound(self.cfg)["total"], "nodes": self.nodes.held(),
                "max_nodes": pruner.cap, "nodes_peak": self.nodes.peak,
                "nodes_asked_to_forget": pruner.asked, "prune_rounds": pruner.rounds,
                "prune_via": pruner.via, "lookups_over_cap": pruner.over_cap}

    def path_of_request(self, op: str, args: tuple) -> str:
        """The path a failed request was about, for its log line."""
        first = args[0] if args else None
        if op in _HANDLE_OPS or op in ("write", "flush", "fsync"):
            h = self.open_files.get(first)  # type: ignore[arg-type]
            if h is None and self.writes is not None:
                h = self.writes.handles.get(first)  # type: ignore[arg-type,assignment]
            if h is not None:
                return h.path
        elif isinstance(first, int):
            node = self.nodes.get(first)
            if node is not None:
                return node.path
        return repr(args[:2])

    def _attrs(self, info: FileInfo, inode: int) -> Attributes:
        a = Attributes()  # (generation 0 and st_nlink 1 already)
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
            a.st_mode = stat.S_IFDIR | (perm or 0o755) | self.open_modes[1]
        else:
            a.st_mode = stat.S_IFREG | (perm or 0o644) | self.open_modes[0]
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
    def lookup(self, parent_inode: int, name: bytes) -> Attributes:
        parent = self.nodes.path(parent_inode)
        sname = name.decode(_FS_ENCODING, _FS_ERRORS)  # os.fsdecode, minus its type checks
        if sname == ".":
            path = parent
        elif sname == "..":
            path = parent_of(parent)
        else:
            path = f"{parent}/{sname}" if parent else sname
        try:
            info = (self.staged_attrs(path) or self.lookups.cached(path)
                    or self.lookups.from_source(path))
        except FuseError as exc:
            ttl = self.meta.ttl(path)
            if exc.errno != errno.ENOENT or ttl <= 0:
                raise
            negative = Attributes()
            negative.st_ino = 0  # a negative entry the kernel caches for entry_timeout
            negative.entry_timeout = ttl
            return negative
        inode = self.nodes.inode_of(path)
        if inode not in self.nodes:
            self.pruner.wait_for_room()
        gen = self.nodes.gen_of(inode, path)
        inode = self.nodes.remember(path, info.size, inode)
        if inode is None:
            raise FuseError(errno.EIO)
        if info.is_dir:
            # the next lookups will most likely be in it: its listing starts
            # now, and they wait for it instead of a remote stat each
            self.lookups.list_in_background(path)
        attrs = self._attrs(info, inode)
        attrs.generation = gen
        return attrs

    def forget(self, items: Iterable[tuple[int, int]]) -> None:
        self.nodes.forget(items)

    @fuse_op()
    def getattr(self, inode: int) -> Attributes:
        node = self.nodes.node(inode)
        info = (self.staged_attrs(node.path) or self.lookups.cached(node.path)
                or self.lookups.from_source(node.path))
        self.nodes.set_size(inode, node, info.size)
        return self._attrs(info, inode)

    @fuse_op()
    def readlink(self, inode: int) -> bytes:
        path = self.nodes.path(inode)
        with self.blocking():
            return os.fsencode(self.volume.readlink(path))

    @fuse_op()
    def access(self, inode: int, mask: int) -> None:
        self.nodes.node(inode)
        if mask & os.W_OK and self.writes is None:
            raise FuseError(errno.EROFS)

    @fuse_op()
    def opendir(self, inode: int) -> int:
        listing = self.lookups.listing(self.nodes.path(inode))
        fh = self._dir_fh.next(listing_tag(listing.entries), self.dir_handles)
        # A snapshot: readdir offsets index it, so paging a large directory
        # never repeats or skips an entry even if the listing changes meanwhile.
        self.dir_handles[fh] = listing.entries
        return fh

    @fuse_op()
    def readdir(self, fh: int, start_id: int, out: DirReply, inode: int = 0) -> None:
        entries = self.dir_handles.get(fh)
        if entries is None:
            entries = self._adopt_dir(fh, inode)
        # past the node table's room, readdirplus entries are bare (see pruner)
        room = self.pruner.room() if out.plus else 0
        for i in range(start_id, len(entries)):
            e = entries[i]
            inode = self.nodes.inode_of(e.path)
            if not self.nodes.shown(inode, e.path):
                continue
            bare = out.plus and room <= 0 and inode not in self.nodes
            attrs = self._attrs(e, inode)
            attrs.generation = self.nodes.gen_of(inode, e.path)
            if not out.add(os.fsencode(e.name), attrs, i + 1, bare):
                break
            if out.plus and not bare:  # every entry the kernel accepted counts as a lookup
                room -= 1
                self.nodes.remember(e.path, e.size, inode)

    def _adopt_dir(self, fh: int, inode: int) -> tuple[FileInfo, ...]:
        """A directory handle opened before this server took the mount over:
        listed again, and kept if it has the same names in the same order
        (its offsets then mean what they meant); else ESTALE."""
        if not inode:
            raise FuseError(errno.EBADF)
        entries = self.lookups.listing(self.nodes.path(inode)).entries
        if tag_of(fh) != listing_tag(entries):
            raise FuseError(errno.ESTALE)
        if fh not in self.dir_handles:
            self.dirs_adopted += 1
        return self.dir_handles.setdefault(fh, entries)

    def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    @fuse_op()
    def statfs(self) -> bytes:
        if self.writes is not None:
            return self.writable_statfs()
        return pack_statfs(blocks=0, bfree=0, bavail=0, files=len(self.nodes), ffree=0,
                           bsize=self.cfg.block_size, namelen=255, frsize=4096)

    # data

    @fuse_op()
    def open(self, inode: int, flags: int) -> tuple[int, bool]:
        if flags & _WRITE_FLAGS:
            if self.writes is None:
                raise FuseError(errno.EROFS)
            return self.open_write(inode, flags)
        node = self.nodes.node(inode)
        path = node.path
        info = self.lookups.cached(path)
        if info is not None and self._written_here_since(path, inode):
            info = None
        if info is None:
            info = self.lookups.from_source(path)
        if info.is_dir:
            raise FuseError(errno.EISDIR)
        keep = self.meta.keep_cache(inode, info)
        return self.open_files.open(path, info, inode, node, keep)

    def _written_here_since(self, path: str, inode: int) -> bool:
        """A writer on this host (another mount) changed `path` after this
        mount's metadata of it was fetched (its stamp, `Volume.written_here`):
        that metadata and the kernel's attributes of the node are dropped,
        and the open asks the source (close-to-open across this host's mounts)."""
        stamp = self.volume.written_here(path)
        if stamp is None or stamp[1] <= self.meta.fetched_ns(path):
            return False
        self.meta.invalidate(path)
        try:  # (a read past the old size would end early; this drops that size)
            self.inval_attrs(inode)
        except OSError as exc:
            log.debug("dropping the kernel's attributes of %s: %s", path, exc)
        return True

    @fuse_op(gone=errno.ESTALE)
    def read(self, fh: int, off: int, size: int, inode: int = 0) -> bytes | memoryview:
        if is_write_handle(fh):
            return self.read_staged(fh, off, size)
        h = self.open_files.get(fh)
        if h is None and inode:  # opened before this server took the mount over
            node = self.nodes.node(inode)
            try:
                info = self.lookups.from_source(node.path)
            except FuseError as exc:  # (the version it pinned is gone)
                raise FuseError(errno.ESTALE if exc.errno == errno.ENOENT else exc.errno) from None
            h = self.open_files.adopt(fh, node.path, info, inode, node)
        return self.open_files.read(fh, off, size, h)

    def answering(self, fh: int, inode: int) -> contextlib.AbstractContextManager[None]:
        """Held while a read's answer is written (`handles.OpenFiles.answering`)."""
        return self.open_files.answering(fh, inode)

    def release(self, fh: int) -> None:
        if is_write_handle(fh):
            self.release_write(fh)
            return
        h = self.open_files.release(fh)
        if h is not None:
            self.nodes.closed(h.inode, h.node)

    # extended attributes

    @fuse_op()
    def listxattr(self, inode: int) -> list[bytes]:
        info = self.lookups.stat(self.nodes.path(inode))
        return self.xattrs.names(inode, info.is_dir)

    @fuse_op()
    def getxattr(self, inode: int, name: bytes, uid: int | None = None) -> bytes:
        if not name.startswith(XATTR_PREFIX):  # (security.*, system.*: no stat for them)
            raise FuseError(ENOATTR)
        info = self.lookups.stat(self.nodes.path(inode))
        return self.xattrs.get(inode, info, name, uid)
