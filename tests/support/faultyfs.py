"""A fault-injecting passthrough file system for tests: a failing cache disk.

    with FaultyMount(real_dir, mountpoint) as fm:   # pyfuse3, in a subprocess
        ... use mountpoint as a cache dir ...
        fm.set_mode("eio")    # every operation fails with EIO
        fm.set_mode("hang")   # every operation blocks until the mode changes
        fm.set_mode("ok")     # plain passthrough again; hung operations go on

Every operation is passed through to `real_dir` (as root: ownership and
modes are the real ones) after a gate that applies the mode. The mode is set
by signal (SIGUSR1 eio, SIGUSR2 hang, SIGHUP ok) and acknowledged in a status
file, so `set_mode` returns only once the file system applies it. `stop()`
releases hung operations, unmounts (lazily if busy) and kills the process,
so nothing is left behind even when a test fails.

Only what a cache dir needs is implemented: lookup, getattr, setattr, mkdir,
rmdir, unlink, rename, create, open, read, write, fsync, release, opendir,
readdir, statfs. Inode numbers are the real ones (the root is FUSE's 1).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from devtools.procs import stop_process

MODES = {"ok": signal.SIGHUP, "eio": signal.SIGUSR1, "hang": signal.SIGUSR2}
START_TIMEOUT = 20.0


class FaultyMount:
    """The test's handle on one faultyfs process."""

    def __init__(self, source: str, mountpoint: str):
        self.source = str(source)
        self.mountpoint = str(mountpoint)
        self.status = self.mountpoint + ".status"
        self.log_path = self.mountpoint + ".log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> FaultyMount:
        os.makedirs(self.source, exist_ok=True)
        os.makedirs(self.mountpoint, exist_ok=True)
        try:
            os.unlink(self.status)
        except FileNotFoundError:
            pass
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=root)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.faultyfs", self.source, self.mountpoint,
                 "--status", self.status], stdout=log, stderr=log, env=env, cwd=root,
                stdin=subprocess.DEVNULL)
        try:
            self._wait_mode("ok")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_mode(self, mode: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"faultyfs exited:\n{Path(self.log_path).read_text()}")
            try:
                if Path(self.status).read_text() == mode:
                    return
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"faultyfs did not switch to {mode!r} within "
                                   f"{START_TIMEOUT:g}s:\n{Path(self.log_path).read_text()}")
            time.sleep(0.01)

    def set_mode(self, mode: str) -> None:
        """Switch to ok / eio / hang; returns once the file system applies it."""
        assert self.proc is not None
        self.proc.send_signal(MODES[mode])
        self._wait_mode(mode)

    def stop(self) -> None:
        """Release hung operations, unmount, end the process. Never raises."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(MODES["ok"])
            time.sleep(0.1)
        for args in (["-u"], ["-uz"]):
            if not _is_mounted(self.mountpoint):
                break
            subprocess.run(["fusermount3", *args, self.mountpoint], capture_output=True,
                           timeout=30)
        stop_process(proc)

    def __enter__(self) -> FaultyMount:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _is_mounted(path: str) -> bool:
    path = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split(" ")[4] == path for line in f)


# -- the file system (runs in the subprocess) ---------------------------------

def _serve(source: str, mountpoint: str, status: str) -> None:
    import pyfuse3
    import trio

    class FaultyFS(pyfuse3.Operations):
        def __init__(self) -> None:
            super().__init__()
            self.paths = {pyfuse3.ROOT_INODE: source}
            self.mode = "ok"
            self.changed = trio.Event()

        # -- faults --

        def set_mode(self, mode: str) -> None:
            self.mode = mode
            self.changed.set()
            self.changed = trio.Event()
            with open(status + ".tmp", "w") as f:
                f.write(mode)
            os.rename(status + ".tmp", status)

        async def gate(self) -> None:
            while self.mode == "hang":
                await self.changed.wait()
            if self.mode == "eio":
                raise pyfuse3.FUSEError(errno.EIO)

        # -- helpers --

        def path(self, inode: int) -> str:
            try:
                return self.paths[inode]
            except KeyError:
                raise pyfuse3.FUSEError(errno.ESTALE) from None

        def child(self, parent: int, name: bytes) -> str:
            return os.path.join(self.path(parent), os.fsdecode(name))

        def attrs(self, path: str) -> pyfuse3.EntryAttributes:
            try:
                st = os.lstat(path)
            except OSError as exc:
                raise pyfuse3.FUSEError(exc.errno) from None
            ino = pyfuse3.ROOT_INODE if path == source else st.st_ino
            self.paths[ino] = path
            e = pyfuse3.EntryAttributes()
            e.st_ino = ino
            for f in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                      "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
                setattr(e, f, getattr(st, f))
            e.st_blksize, e.st_blocks = st.st_blksize, st.st_blocks
            e.generation = 0
            e.entry_timeout = e.attr_timeout = 0  # every access reaches the gate
            return e

        def run(self, fn, *args):
            try:
                return fn(*args)
            except OSError as exc:
                raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
            except Exception:  # a bug here must not end the file system mid-test
                logging.getLogger("faultyfs").exception("%s%r failed", fn, args)
                raise pyfuse3.FUSEError(errno.EIO) from None

        # -- operations --

        async def lookup(self, parent_inode, name, ctx=None):
            await self.gate()
            return self.attrs(self.child(parent_inode, name))

        async def getattr(self, inode, ctx=None):
            await self.gate()
            return self.attrs(self.path(inode))

        async def setattr(self, inode, attr, fields, fh, ctx):
            await self.gate()
            p = self.path(inode)
            if fields.update_mode:
                self.run(os.chmod, p, stat.S_IMODE(attr.st_mode))
            if fields.update_uid or fields.update_gid:
                self.run(os.chown, p, attr.st_uid if fields.update_uid else -1,
                         attr.st_gid if fields.update_gid else -1)
            if fields.update_size:
                self.run(os.truncate, p, attr.st_size)
            if fields.update_atime or fields.update_mtime:
                st = self.run(os.lstat, p)
                ns = (attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                      attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns)
                self.run(lambda: os.utime(p, ns=ns))
            return self.attrs(p)

        async def mkdir(self, parent_inode, name, mode, ctx):
            await self.gate()
            p = self.child(parent_inode, name)
            self.run(os.mkdir, p, mode)
            return self.attrs(p)

        async def rmdir(self, parent_inode, name, ctx):
            await self.gate()
            self.run(os.rmdir, self.child(parent_inode, name))

        async def unlink(self, parent_inode, name, ctx):
            await self.gate()
            self.run(os.unlink, self.child(parent_inode, name))

        async def rename(self, old_parent, old_name, new_parent, new_name, flags, ctx):
            await self.gate()
            new = self.child(new_parent, new_name)
            self.run(os.rename, self.child(old_parent, old_name), new)
            self.attrs(new)  # the inode now lives at its new path

        async def create(self, parent_inode, name, mode, flags, ctx):
            await self.gate()
            p = self.child(parent_inode, name)
            fd = self.run(os.open, p, flags | os.O_CREAT, mode)
            return pyfuse3.FileInfo(fh=fd), self.attrs(p)

        async def open(self, inode, flags, ctx):
            await self.gate()
            fd = self.run(os.open, self.path(inode), flags & ~os.O_CREAT)
            return pyfuse3.FileInfo(fh=fd)

        async def read(self, fh, off, size):
            await self.gate()
            return self.run(os.pread, fh, size, off)

        async def write(self, fh, off, buf):
            await self.gate()
            return self.run(os.pwrite, fh, buf, off)

        async def flush(self, fh):
            await self.gate()

        async def fsync(self, fh, datasync):
            await self.gate()
            self.run(os.fsync, fh)

        async def release(self, fh):
            os.close(fh)  # never fails: the kernel has already let go

        async def opendir(self, inode, ctx):
            await self.gate()
            return inode

        async def readdir(self, fh, start_id, token):
            await self.gate()
            base = self.path(fh)
            names = sorted(self.run(os.listdir, base))
            for i, name in enumerate(names[start_id:], start_id + 1):
                try:
                    attrs = self.attrs(os.path.join(base, name))
                except pyfuse3.FUSEError:
                    continue  # removed meanwhile
                if not pyfuse3.readdir_reply(token, os.fsencode(name), attrs, i):
                    return

        async def releasedir(self, fh):
            pass

        async def statfs(self, ctx):
            await self.gate()
            st = self.run(os.statvfs, source)
            out = pyfuse3.StatvfsData()
            for f in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                      "f_ffree", "f_favail", "f_namemax"):
                setattr(out, f, getattr(st, f))
            return out

    fs = FaultyFS()
    names = {sig: mode for mode, sig in MODES.items()}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async def signals() -> None:
                with trio.open_signal_receiver(*names, signal.SIGTERM, signal.SIGINT) as it:
                    async for sig in it:
                        if sig in names:
                            fs.set_mode(names[sig])
                        else:
                            fs.set_mode("ok")
                            pyfuse3.terminate()
                            return
            nursery.start_soon(signals)
            await trio.sleep(0)  # the receiver is installed before we say ready
            fs.set_mode("ok")
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    pyfuse3.init(fs, mountpoint, {"fsname=faultyfs", "subtype=faultyfs"})
    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="fault-injecting passthrough FUSE file system")
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("--status", required=True, help="file the current mode is written to")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    _serve(os.path.abspath(a.source), os.path.abspath(a.mountpoint), a.status)


if __name__ == "__main__":
    main()
