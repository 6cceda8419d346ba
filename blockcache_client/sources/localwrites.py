"""Local-directory writes: a temp file beside the target, renamed over it.

An upload writes its parts (in parallel, `pwrite` at their offsets) into
`.NAME.blockcache-XXXXXXXX` in the target's directory, made with O_EXCL and
mode 0600 (no other uid reads it half-written). `complete` fsyncs it, gives
it the mode a new file gets (0666 less the umask), renames it over NAME
(rename(2): a reader opens the old file or the new one, never a mix) and
fsyncs the directory: once it returns the file is on the disk under its
name. A failed upload removes the temp file; a process killed mid-upload
leaves it (hidden by its dot, never under the target's name): remove such
files by hand. (An O_TMPFILE file, nameless until linked, would leave
nothing; but linking it through /proc/self/fd fails with EXDEV in some
containers, and AT_EMPTY_PATH needs a capability on older kernels.)

A local file's version is its mtime and size (`fileinfo.stat_version`): a
new file that would show the same pair as the one it replaces (same size,
written within one mtime tick) is given the old mtime plus a millisecond,
so its blocks get new keys.
"""

from __future__ import annotations

import os
import secrets

from .backend import Backend
from .fileinfo import FileInfo, info_of

MTIME_STEP_NS = 1_000_000


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for
    every thread, for a moment)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _info(rel: str, st: os.stat_result) -> FileInfo:
    """The FileInfo the reader's stat (fsspec's local `info`) gives this file."""
    return info_of({"name": rel, "size": st.st_size, "type": "file", "mtime": st.st_mtime,
                    "mode": st.st_mode}, rel)


class LocalWrites:
    """The writes of one volume in a local directory (see the module doc)."""

    min_part = 1
    renames_dirs = True

    def __init__(self, backend: Backend):
        self.backend = backend

    def path(self, rel: str) -> str:
        return self.backend.full_path(rel)

    def call(self, what: str, rel: str, fn):
        """fn() as one `Backend.call`: bounded (a hung NFS server), errors named."""
        return self.backend.call(what, rel, lambda **tkw: fn())

    def put(self, rel: str, data: memoryview) -> FileInfo:
        upload = self.begin(rel)
        try:
            upload.part(1, 0, data)
            return upload.complete(len(data), 1)
        except BaseException:
            upload.abort()
            raise

    def begin(self, rel: str) -> LocalUpload:
        return self.call("upload", rel, lambda: LocalUpload(self, rel))

    def mkdir(self, rel: str) -> None:
        self.call("mkdir", rel, lambda: os.mkdir(self.path(rel), 0o777))

    def rmdir(self, rel: str) -> None:
        self.call("rmdir", rel, lambda: os.rmdir(self.path(rel)))

    def unlink(self, rel: str) -> None:
        self.call("unlink", rel, lambda: os.unlink(self.path(rel)))

    def rename(self, src: str, dst: str, old: FileInfo) -> FileInfo | None:
        """rename(2); the new name's FileInfo if it holds `old`'s bytes (the
        file kept its mtime and size: nobody changed it since `old` was seen)."""
        def move() -> FileInfo | None:
            os.rename(self.path(src), self.path(dst))
            _sync_dir(os.path.dirname(self.path(dst)))
            info = _info(dst, os.stat(self.path(dst)))
            return info if info.version == old.version and not old.is_dir else None
        return self.call("rename", src, move)


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalUpload:
    """One file being written beside its target (see the module doc)."""

    def __init__(self, writes: LocalWrites, rel: str):
        self.writes = writes
        self.target = target = writes.path(rel)
        self.rel = rel
        self.dir = os.path.dirname(target)
        self.temp = os.path.join(self.dir, f".{os.path.basename(target)}.blockcache-"
                                           f"{secrets.token_hex(4)}")
        self.fd = os.open(self.temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                          | os.O_CLOEXEC, 0o600)
        self.named = True  # the temp name exists (until renamed or removed)

    def part(self, number: int, offset: int, data: memoryview) -> None:
        def write() -> None:
            view, at = memoryview(data), offset
            while view:
                n = os.pwrite(self.fd, view, at)
                view, at = view[n:], at + n
        self.writes.call("upload", self.rel, write)

    def complete(self, size: int, parts: int) -> FileInfo:
        """(`parts` is S3's: here the file is cut to `size`, whatever was written.)"""
        return self.writes.call("upload", self.rel, lambda: self._complete(size))

    def _complete(self, size: int) -> FileInfo:
        fd = self.fd
        os.ftruncate(fd, size)  # a file of 0 bytes had no part
        os.fsync(fd)
        os.fchmod(fd, 0o666 & ~_umask())
        self._distinct(os.fstat(fd))
        os.rename(self.temp, self.target)
        self.named = False  # the temp name is the target's now
        info = _info(self.rel, os.fstat(fd))
        os.close(fd)
        self.fd = -1
        _sync_dir(self.dir)
        return info

    def _distinct(self, st: os.stat_result) -> None:
        """Move this file's mtime off the one it replaces if their versions
        would be equal (same size, same mtime tick): see the module doc."""
        try:
            old = os.stat(self.target)
        except OSError:
            return
        if _info(self.rel, old).version == _info(self.rel, st).version:
            when = old.st_mtime_ns + MTIME_STEP_NS
            os.utime(self.fd, ns=(when, when))

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.named:
            try:
                os.unlink(self.temp)
            except OSError:
                pass
