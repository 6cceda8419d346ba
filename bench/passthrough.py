"""A minimal read-only passthrough pyfuse3 file system: the floor for a
Python FUSE client on this machine, and the "no cache" peer over a remote.

    python -m bench.passthrough SOURCE MOUNTPOINT [--delay 0.002] [--ttl 300]

SOURCE a local directory: served with plain os calls on the event loop (the
cheapest thing a pyfuse3 file system can do per request). With --delay, the
same directory is read through `latency::` (every stat, listing and read a
delayed remote request, on a thread pool), with no caching at all: what
reading the remote directly through FUSE costs.

Same pyfuse3 asyncio mode, readdirplus and kernel entry/attr timeouts as
fsclient, so the comparison measures what fsclient adds, nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import itertools
import os
import signal
import stat
import sys
from concurrent.futures import ThreadPoolExecutor

import pyfuse3
import pyfuse3.asyncio

pyfuse3.asyncio.enable()


def _attrs(st_mode: int, size: int, mtime_ns: int, ino: int, ttl: float) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    a.st_mode = st_mode
    a.st_nlink = 1
    a.st_size = size
    a.st_blksize = 128 << 10
    a.st_blocks = (size + 511) // 512
    a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = mtime_ns
    a.entry_timeout = a.attr_timeout = ttl
    return a


class _Table(pyfuse3.Operations):
    """Inode = the path's index in a table that only grows (a benchmark's
    dataset fits); readdir pages over a listing snapshot."""

    def __init__(self, root, ttl: float):
        super().__init__()
        self.root = root
        self.ttl = ttl
        self.paths = {pyfuse3.ROOT_INODE: root}
        self.inodes = {root: pyfuse3.ROOT_INODE}
        self._next = itertools.count(pyfuse3.ROOT_INODE + 1)
        self.dirs: dict[int, list] = {}
        self._fh = itertools.count(1)

    def _ino(self, path) -> int:
        ino = self.inodes.get(path)
        if ino is None:
            ino = next(self._next)
            self.inodes[path] = ino
            self.paths[ino] = path
        return ino

    async def readdir(self, fh, start_id, token):
        entries = self.dirs[fh]
        for i in range(start_id, len(entries)):
            name, attrs = entries[i]
            if not pyfuse3.readdir_reply(token, name, attrs, i + 1):
                break

    async def releasedir(self, fh):
        self.dirs.pop(fh, None)


class LocalPassthrough(_Table):
    """Local directory, os calls inline on the event loop."""

    def __init__(self, root: str, ttl: float):
        super().__init__(os.fsencode(root), ttl)

    def _stat(self, path: bytes) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        return _attrs(st.st_mode, st.st_size, st.st_mtime_ns, self._ino(path), self.ttl)

    async def lookup(self, parent_inode, name, ctx=None):
        return self._stat(os.path.join(self.paths[parent_inode], name))

    async def getattr(self, inode, ctx=None):
        return self._stat(self.paths[inode])

    async def readlink(self, inode, ctx=None):
        return os.readlink(self.paths[inode])

    async def opendir(self, inode, ctx=None):
        fh = next(self._fh)
        path = self.paths[inode]
        self.dirs[fh] = sorted((e.name, self._stat(os.path.join(path, e.name)))
                               for e in os.scandir(path))
        return fh

    async def open(self, inode, flags, ctx=None):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=os.open(self.paths[inode], os.O_RDONLY))

    async def read(self, fh, off, size):
        return os.pread(fh, size, off)

    async def release(self, fh):
        os.close(fh)


class RemotePassthrough(_Table):
    """An fsspec file system, every call a remote request on a thread pool."""

    def __init__(self, fs, root: str, ttl: float, threads: int = 32):
        super().__init__(root.rstrip("/"), ttl)
        self.fs = fs
        self.files: dict[int, tuple[str, int]] = {}
        self.pool = ThreadPoolExecutor(threads)

    def _call(self, fn, *args, **kw):
        return asyncio.get_running_loop().run_in_executor(self.pool,
                                                          functools.partial(fn, *args, **kw))

    def _attrs(self, info: dict) -> pyfuse3.EntryAttributes:
        path = info["name"].rstrip("/")
        is_dir = info.get("type") == "directory"
        mode = (stat.S_IFDIR | 0o755) if is_dir else (stat.S_IFREG | 0o644)
        mtime = int(float(info.get("mtime") or 0) * 1e9)
        return _attrs(mode, int(info.get("size") or 0), mtime, self._ino(path), self.ttl)

    async def _info(self, path: str) -> pyfuse3.EntryAttributes:
        try:
            return self._attrs(await self._call(self.fs.info, path))
        except FileNotFoundError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    async def lookup(self, parent_inode, name, ctx=None):
        return await self._info(f"{self.paths[parent_inode]}/{os.fsdecode(name)}")

    async def getattr(self, inode, ctx=None):
        return await self._info(self.paths[inode])

    async def opendir(self, inode, ctx=None):
        fh = next(self._fh)
        listing = await self._call(self.fs.ls, self.paths[inode], detail=True)
        self.dirs[fh] = sorted((os.fsencode(i["name"].rstrip("/").rpartition("/")[2]),
                                self._attrs(i)) for i in listing)
        return fh

    async def open(self, inode, flags, ctx=None):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        path = self.paths[inode]
        info = await self._call(self.fs.info, path)
        fh = next(self._fh)
        self.files[fh] = (path, int(info["size"]))
        return pyfuse3.FileInfo(fh=fh)

    async def read(self, fh, off, size):
        path, length = self.files[fh]
        end = min(off + size, length)
        if off >= end:
            return b""
        return await self._call(self.fs.cat_file, path, start=off, end=end)

    async def release(self, fh):
        self.files.pop(fh, None)


async def serve(ops: pyfuse3.Operations, mountpoint: str) -> None:
    opts = set(pyfuse3.default_options) | {"ro", "fsname=passthrough", "noatime"}
    pyfuse3.init(ops, mountpoint, opts)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pyfuse3.terminate)
    try:
        await pyfuse3.main()
    finally:
        pyfuse3.close(unmount=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.passthrough")
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("--delay", type=float, default=None,
                   help="read SOURCE through latency:: with this many seconds per request")
    p.add_argument("--ttl", type=float, default=300.0, help="kernel entry/attr timeout")
    a = p.parse_args(argv)
    if a.delay is None:
        ops: pyfuse3.Operations = LocalPassthrough(a.source, a.ttl)
    else:
        from devtools.latencyfs import LatencyFileSystem
        ops = RemotePassthrough(LatencyFileSystem(target_protocol="file", delay=a.delay),
                                os.path.abspath(a.source), a.ttl)
    asyncio.run(serve(ops, a.mountpoint))
    return 0


if __name__ == "__main__":
    sys.exit(main())
