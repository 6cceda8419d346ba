"""Files on one cache dir. Every method here does blocking I/O and runs on
that dir's worker thread (see `filler`), never on the event loop.

    <dir>/blockcached.lock      flock held by the running daemon
    <dir>/blocks/<xx>/<yy>/<key>  complete block files, 0644 (readers in pods);
                                `blocks/` and the fan-out dirs 0711: readers
                                compute paths and never list, so a tenant
                                cannot list another's block names
    <dir>/tmp/<pid>.<n>         in-flight writes (tmp/ 0700)

A block is written to tmp/ and renamed to its final name, so a crash of the
daemon at any point leaves either no file or the complete file under the key;
leftovers in tmp/ are deleted at start. Blocks are not fsynced: this is a
read cache, whose every byte can be fetched again, and readers authenticate
every chunk, so what an OS crash or power loss can leave (a short, empty or
torn file under a block name) is a miss, never wrong bytes (DESIGN.md,
"Why blocks are not fsynced"). Paths come only from
`blockcache_client.contract.layout`, from keys that `BlockKey.parse` accepted.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
from dataclasses import dataclass

from blockcache_client.common import safeopen
from blockcache_client.contract import layout

from .daemonarea import AreaSpan
from .scan import TREE_MODE, Placement, ScanResult, scan_blocks

log = logging.getLogger(__name__)

FILE_MODE = 0o644
DIR_MODE = 0o755   # the cache dir itself (and parents made for it)
TMP_MODE = 0o700   # tmp/: readers never look there (blocks/: scan.TREE_MODE)


@dataclass(frozen=True, slots=True)
class FsSpace:
    free_bytes: int
    free_inodes: int


class TreeMoved(OSError):
    """`blocks/` or `tmp/` were renamed or replaced while the store held them
    open: its writes would land where readers never look."""


class Store:
    """One cache dir on disk.

    Nothing below the dir itself is trusted to be what it should be: every
    operation goes through descriptors of `blocks/` and `tmp/` opened without
    following symlinks, and reaches a fan-out leaf with `safeopen.open_beneath`
    (no symlink in any component). A symlink, file or FIFO where one of these
    dirs belongs is removed and the dir made again, so no write, rename,
    unlink or utime can land outside the tree (DESIGN.md, "The cache tree").
    """

    def __init__(self, path: str):
        self.path = path
        self.blocks = os.path.join(path, layout.BLOCKS_DIR)
        self.tmp = os.path.join(path, layout.TMP_DIR)
        self._names = itertools.count()
        self._blocks_fd = self._tmp_fd = -1
        self._preallocate = True  # until the file system says it cannot

    def prepare(self) -> None:
        """Create the dir skeleton if missing, and (re)open `blocks/` and
        `tmp/` (a fresh disk may have been mounted in the dir's place), in
        their modes (a tree of an older daemon had 0755; the scan mends
        the fan-out dirs)."""
        _makedir(self.path)
        root = safeopen.open_dir(self.path)
        try:
            blocks, tmp = (_own_dir(root, name, self.path, mode)
                           for name, mode in ((layout.BLOCKS_DIR, TREE_MODE),
                                              (layout.TMP_DIR, TMP_MODE)))
            for fd, mode in ((blocks, TREE_MODE), (tmp, TMP_MODE)):
                os.fchmod(fd, mode)
        finally:
            os.close(root)
        self.close()
        self._blocks_fd, self._tmp_fd = blocks, tmp

    def scan(self, placement: Placement | None, me: int, processes: int = 1) -> ScanResult:
        """Find the complete blocks this dir owns (see `scan.scan_blocks`)."""
        return scan_blocks(self.path, self.blocks, placement, me, processes)

    def close(self) -> None:
        for fd in (self._blocks_fd, self._tmp_fd):
            if fd >= 0:
                os.close(fd)
        self._blocks_fd = self._tmp_fd = -1

    def block_path(self, key: str) -> str:
        """`<dir>/blocks/xx/yy/<key>`, built without os.path.join: it is on
        every lookup hit."""
        return f"{self.path}/{layout.block_relpath(key)}"

    def _leaf(self, fan: str, create: bool) -> int:
        """An O_PATH fd of the fan-out dir `xx/yy`, never through a symlink:
        with `create`, missing dirs are made and anything else in their place
        is replaced; without, FileNotFoundError where it is not a real dir."""
        try:
            return safeopen.open_beneath(self._blocks_fd, fan, _LEAF)
        except OSError as exc:
            if exc.errno not in _NOT_A_DIR:
                raise
            if not create:
                raise FileNotFoundError(errno.ENOENT, "no fan-out dir", fan) from None
        top = _own_dir(self._blocks_fd, fan[:2], self.blocks, TREE_MODE)
        try:
            os.close(_own_dir(top, fan[3:], f"{self.blocks}/{fan[:2]}", TREE_MODE))
        finally:
            os.close(top)
        return safeopen.open_beneath(self._blocks_fd, fan, _LEAF)

    def write(self, key: str, data: bytes | memoryview | AreaSpan) -> None:
        """Write one block: tmp file, then rename into place (no fsync: see
        the module docstring). An `AreaSpan` (a block in a fill area slot)
        is copied by the kernel, into blocks reserved for it first."""
        tmp = f"{os.getpid()}.{next(self._names)}"
        fd = os.open(tmp, _CREATE, FILE_MODE, dir_fd=self._tmp_fd)
        try:
            if isinstance(data, AreaSpan):
                self._preallocate = data.write_to(fd, self._preallocate)
            else:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            os.fchmod(fd, FILE_MODE)  # umask must not hide blocks from readers
        except BaseException:
            os.close(fd)
            _unlink(tmp, self._tmp_fd)
            raise
        os.close(fd)
        try:
            leaf = self._leaf(layout.fanout(key), create=True)
            try:
                os.rename(tmp, key, src_dir_fd=self._tmp_fd, dst_dir_fd=leaf)
            finally:
                os.close(leaf)
        except BaseException:
            _unlink(tmp, self._tmp_fd)
            raise

    def unlink(self, key: str) -> None:
        try:
            leaf = self._leaf(layout.fanout(key), create=False)
        except FileNotFoundError:
            return
        try:
            _unlink(key, leaf)
        finally:
            os.close(leaf)

    def exists(self, key: str) -> bool:
        """Whether something is at `key`'s block path (not following links)."""
        try:
            leaf = self._leaf(layout.fanout(key), create=False)
        except FileNotFoundError:
            return False
        try:
            os.stat(key, dir_fd=leaf, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(leaf)

    def touch_times(self, keys: list[tuple[str, int]]) -> None:
        """Set mtimes (ns) so a restart restores approximate LRU order, and
        the policy's frequency in their nanoseconds (`policy.encode_mtime_ns`)."""
        for key, ns in keys:
            try:
                leaf = self._leaf(layout.fanout(key), create=False)
            except FileNotFoundError:
                continue  # evicted meanwhile
            try:
                os.utime(key, ns=(ns, ns), dir_fd=leaf, follow_symlinks=False)
            except FileNotFoundError:
                pass
            finally:
                os.close(leaf)

    def space(self) -> FsSpace:
        """Free space; `TreeMoved` if `blocks/` or `tmp/` at the dir's path
        are no longer the dirs this store writes in."""
        for fd, path in ((self._blocks_fd, self.blocks), (self._tmp_fd, self.tmp)):
            if fd < 0:
                continue
            held = os.fstat(fd)
            try:
                there = os.lstat(path)
            except FileNotFoundError:
                there = None
            if there is None or (held.st_dev, held.st_ino) != (there.st_dev, there.st_ino):
                raise TreeMoved(errno.ESTALE, "replaced or moved behind the daemon", path)
        st = os.statvfs(self.path)
        return FsSpace(st.f_bavail * st.f_frsize, st.f_favail)

    def probe(self) -> None:
        """Write, read back and delete a small file through tmp/ and blocks/;
        raises OSError if the dir is not usable. Recreates the skeleton
        first, so a fresh disk mounted in its place is taken into use."""
        self.prepare()
        tmp, dst = f"probe.{os.getpid()}", ".probe"
        payload = os.urandom(64)
        _unlink(tmp, self._tmp_fd)  # a crashed probe's, or anything planted there
        fd = os.open(tmp, _CREATE, FILE_MODE, dir_fd=self._tmp_fd)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, dst, src_dir_fd=self._tmp_fd, dst_dir_fd=self._blocks_fd)
        fd = os.open(dst, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=self._blocks_fd)
        try:
            if os.read(fd, 128) != payload:
                raise OSError(5, "probe file read back different bytes", f"{self.blocks}/{dst}")
        finally:
            os.close(fd)
        os.unlink(dst, dir_fd=self._blocks_fd)

    def clear_tmp(self) -> int:
        """Delete every leftover in tmp/ (writes a crash interrupted); a dir
        in it is removed whole, never followed if it is a link."""
        n = 0
        with os.scandir(self._tmp_fd) as it:
            names = [e.name for e in it]
        for name in names:
            try:
                os.unlink(name, dir_fd=self._tmp_fd)
            except IsADirectoryError:
                shutil.rmtree(name, dir_fd=self._tmp_fd, ignore_errors=True)
            except FileNotFoundError:
                continue
            n += 1
        return n


# a fan-out leaf, reached to create, rename, unlink or utime in it
_LEAF = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY
# read too: a copy from a fill area is checked in its tmp file (AreaSpan.write_to)
_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# what opening a dir path gives where a component is a symlink, a file, or missing
_NOT_A_DIR = frozenset({errno.ELOOP, errno.ENOTDIR, errno.ENOENT})


def _own_dir(parent: int, name: str, where: str, mode: int) -> int:
    """A readable fd of the real dir `name` in `parent` (made in `mode` if
    missing); a symlink or anything else in its place is removed first, logged."""
    for _ in range(3):
        try:
            return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=parent)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            log.warning("%s/%s is not a directory (a symlink or a file); removing it", where, name)
            _unlink(name, parent)
        try:
            os.mkdir(name, mode, dir_fd=parent)
            os.chmod(name, mode, dir_fd=parent, follow_symlinks=False)
        except FileExistsError:
            pass
    raise OSError(errno.ELOOP, "keeps being replaced by something that is not a directory",
                  f"{where}/{name}")


def _makedir(path: str) -> None:
    """mkdir -p, every dir it makes 0755 whatever the umask (readers in pods
    list them)."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if not parent or parent == path:
            raise
        _makedir(parent)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            return
    os.chmod(path, DIR_MODE)


def _unlink(path: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
