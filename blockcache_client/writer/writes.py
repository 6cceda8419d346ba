"""A volume's writes in one process: files staged while open, one upload each, metadata changes.

`Writes.open` stages a file: a new one, or one truncated (O_TRUNC, "wb"); a
file already staged here is shared (opened twice, it is one file, as on a
local disk). Opening an existing non-empty file to write without truncating
it is refused with EOPNOTSUPP: a file of the volume is written whole,
staged, then uploaded as one object, and its remote bytes are never read
back into staging to be patched (`OVERWRITE_HINT` says what to do instead).
`WriteHandle.commit` (close, fsync) uploads the staged bytes if they changed
since the last upload (`upload.Uploader`), returns only once the object is
in the remote, and raises EIO if it is not; the new version is then
cached in the background (`written`). Releasing the last handle drops the
staged bytes.

`mkdir`, `rmdir`, `unlink` and `rename` ask the source first (a fresh stat:
no cached answer decides a change) and answer as a local file system:
ENOENT, ENOTDIR, EISDIR, EEXIST, ENOTEMPTY; EBUSY for a rename onto a
file staged here and still open; EXDEV for a directory renamed on S3 (`mv` then copies it);
EROFS for a source that cannot be written (`remotewrites.writes_for`).
Unlinking a file still open here drops it: its handles write on, and
nothing is uploaded. After each change `changed(path, FileInfo or None,
tree)` tells the owner's metadata caches (None: forget the path; `tree`:
everything under it too).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
import time
from collections.abc import Callable

from ..common.counters import Counters
from ..sources.backend import Backend
from ..sources.fileinfo import FileInfo
from ..sources.remotewrites import RemoteWrites, writes_for
from . import staging
from .stagedfile import StagedFile
from .stamps import Stamps
from .streaming import Stream
from .upload import DEFAULT_PARALLEL, DEFAULT_PART_BYTES, Uploader
from .written import WrittenBlocks

log = logging.getLogger(__name__)

OVERWRITE_HINT = ("a file of the volume is written whole (staged, then uploaded as one "
                  "object): open it truncated (O_TRUNC, 'wb'), or write a new file and "
                  "rename it over this one")

Changed = Callable[[str, "FileInfo | None", bool], None]


@dataclasses.dataclass(frozen=True)
class WriteOptions:
    """How a volume stages and uploads (`Volume`'s arguments of the same names)."""

    staging_dir: str | None = None        # None: staging.default_dir()
    staging_bytes: int = staging.DEFAULT_LIMIT
    upload_part_bytes: int = DEFAULT_PART_BYTES
    upload_parallel: int = DEFAULT_PARALLEL


class _Held:
    """One staged file and who holds it: open handles, and cache jobs."""

    __slots__ = ("file", "opens", "caching", "unlinked", "info", "stream")

    def __init__(self, file: StagedFile, stream: Stream):
        self.file = file
        self.stream = stream  # its parts sent while it is written
        file.on_change = stream.changed
        self.opens = 0
        self.caching = 0
        self.unlinked = False
        self.info: FileInfo | None = None


class Writes:
    """One volume's writes in this process (see the module doc). Thread-safe."""

    def __init__(self, volume: str, backend: Backend, volume_key: bytes, chunk_size: int,
                 counters: Counters, written: WrittenBlocks, changed: Changed,
                 options: WriteOptions, stamps: Stamps | None = None):
        self.volume = volume
        self.backend = backend
        self.counters = counters
        self.written = written
        self._owner_changed = changed
        self.stamps = stamps  # this host's other readers learn of each change
        self.options = options
        self._volume_key = volume_key
        self._chunk_size = chunk_size
        self._remote: RemoteWrites | None = None
        self._area: staging.StagingArea | None = None
        self._uploader: Uploader | None = None
        self._staged: dict[str, _Held] = {}
        self._lock = threading.Lock()

    # -- parts made at the first write -------------------------------------------

    def remote(self) -> RemoteWrites:
        """The source's writes; OSError(EROFS) if it takes none."""
        if self._remote is None:
            self._remote = writes_for(self.backend)
            self._uploader = Uploader(self._remote, self.options.upload_part_bytes,
                                      self.options.upload_parallel)
        return self._remote

    def area(self) -> staging.StagingArea:
        if self._area is None:
            self._area = staging.StagingArea(self.options.staging_dir or staging.default_dir(),
                                             self.options.staging_bytes, self.volume)
        return self._area

    def changed(self, rel: str, info: FileInfo | None, tree: bool) -> None:
        """Tell the owner's caches, and this host's other readers (a stamp)."""
        self._owner_changed(rel, info, tree)
        if self.stamps is not None and not tree:
            self.stamps.put(rel, info)

    def close(self) -> None:
        """Drop every staged file (nothing is uploaded) and stop the threads."""
        self.written.close()
        if self.stamps is not None:
            self.stamps.close()
        with self._lock:
            held, self._staged = list(self._staged.values()), {}
        for h in held:
            h.stream.drop()
            h.file.dispose()
        if self._uploader is not None:
            self._uploader.close()

    def stats(self) -> dict:
        area = self._area
        return {"staged_files": len(self._staged),
                "staging_used_bytes": area.used if area is not None else 0,
                "written_caching": self.written.pending()}

    # -- files -------------------------------------------------------------------

    def _stat(self, rel: str) -> FileInfo | None:
        """What the source holds at `rel` now; None if nothing."""
        try:
            return self.backend.stat(rel)
        except FileNotFoundError:
            return None

    def _check_parent(self, rel: str, what: str) -> None:
        parent = rel.rpartition("/")[0]
        if not parent:
            return
        found = self._stat(parent)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, f"{what} {rel}: no directory {parent} in "
                                                  f"{self.backend.source}")
        if not found.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, f"{what} {rel}: {parent} is not a "
                                                    f"directory in {self.backend.source}")

    def open(self, rel: str, truncate: bool = True, checked: bool = False) -> WriteHandle:
        """A handle writing `rel` (see the module doc). `checked`: the caller
        knows `rel` is no directory and its parent is one (FUSE's kernel
        looked them up); else the source is asked."""
        if not rel:
            raise IsADirectoryError(errno.EISDIR, f"open / of volume {self.volume} to write: "
                                                  f"the root is a directory")
        self.remote()
        with self._lock:
            held = self._staged.get(rel)
            if held is not None:
                held.opens += 1
        if held is None:
            if not checked:
                self._check_parent(rel, "open")
            found = self._stat(rel) if not (checked and truncate) else None
            if found is not None and found.is_dir:
                raise IsADirectoryError(errno.EISDIR, f"open {rel} to write: a directory in "
                                                      f"{self.backend.source}")
            if found is not None and found.size and not truncate:
                raise OSError(errno.EOPNOTSUPP, f"open {rel} to write without truncating "
                                                f"it: {OVERWRITE_HINT}")
            held = self._new(rel)
        elif truncate:
            held.file.truncate(0)
        return WriteHandle(self, held)

    def _new(self, rel: str) -> _Held:
        staged = StagedFile(self.area(), self._volume_key, self._chunk_size, rel)
        made = _Held(staged, Stream(self._uploader, staged))
        made.opens = 1
        with self._lock:
            held = self._staged.setdefault(rel, made)  # another thread may have won
            if held is not made:
                held.opens += 1
        if held is not made:
            made.file.dispose()
        return held

    def staged(self, rel: str) -> StagedFile | None:
        """The staged file open at `rel` in this process, if any."""
        held = self._staged.get(rel)
        return held.file if held is not None else None

    def commit(self, held: _Held) -> FileInfo | None:
        """Upload `held`'s file if it changed since its last upload."""
        held.stream.pause()  # (its parts in flight take the file's lock to read)
        try:
            return self._commit(held)
        finally:
            held.stream.resume()

    def _commit(self, held: _Held) -> FileInfo | None:
        f = held.file
        with f.lock:
            if held.unlinked or not f.unsaved:
                return held.info
            f.flush()
            snap, generation = f.snapshot(), f.generation
            start = time.monotonic()
            try:
                info = held.stream.finish(snap)  # what was sent ahead, and the rest
                if info is False:
                    info = self._uploader.upload(f.rel, snap)
            except Exception as exc:
                self.counters.add("uploads_failed")
                log.warning("upload of %s to %s failed: %s", f.rel, self.backend.source, exc)
                raise OSError(errno.EIO, f"upload of {f.rel} to {self.backend.source} failed "
                                         f"(nothing of it is there): {exc}") from exc
            self.counters.add("uploads")
            self.counters.add("uploaded_bytes", snap.size)
            self.counters.add("upload_ms", round((time.monotonic() - start) * 1000))
            f.unsaved = False
            held.info = info
            with self._lock:
                held.caching += info is not None
        self.changed(f.rel, info, False)
        if info is not None:
            self.written.uploaded(f, info, generation, lambda: self._let_go(held, cache=True))
        return info

    def release(self, held: _Held) -> None:
        """One handle of `held` closed (its bytes uploaded or not)."""
        self._let_go(held, cache=False)

    def _let_go(self, held: _Held, cache: bool) -> None:
        with self._lock:
            if cache:
                held.caching -= 1
            else:
                held.opens -= 1
                if held.opens == 0 and self._staged.get(held.file.rel) is held:
                    del self._staged[held.file.rel]
            closed = held.opens == 0 and not cache
            unused = held.opens == 0 and held.caching == 0
        if closed:
            held.stream.drop()  # parts sent ahead of a commit that never came
        if unused:
            held.file.dispose()

    # -- metadata ----------------------------------------------------------------

    def mkdir(self, rel: str) -> None:
        remote = self.remote()
        if not rel or self._stat(rel) is not None:
            raise FileExistsError(errno.EEXIST, f"mkdir {rel or '/'}: exists in "
                                                f"{self.backend.source}")
        self._check_parent(rel, "mkdir")
        remote.mkdir(rel)
        self.changed(rel, None, False)

    def rmdir(self, rel: str) -> None:
        remote = self.remote()
        if not rel:
            raise OSError(errno.EBUSY, f"rmdir /: the root of volume {self.volume}")
        found = self._stat(rel)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, f"rmdir {rel}: not in {self.backend.source}")
        if not found.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, f"rmdir {rel}: not a directory")
        if self._staged_under(rel):
            raise OSError(errno.ENOTEMPTY, f"rmdir {rel}: files are being written in it")
        remote.rmdir(rel)
        self.changed(rel, None, True)

    def unlink(self, rel: str) -> None:
        remote = self.remote()
        with self._lock:
            held = self._staged.pop(rel, None)
            if held is not None:
                held.unlinked = True  # its handles write on; nothing is uploaded
        if held is not None:
            held.stream.drop()
        found = self._stat(rel)
        if found is None:
            if held is not None:
                return
            raise FileNotFoundError(errno.ENOENT, f"unlink {rel}: not in {self.backend.source}")
        if found.is_dir:
            raise IsADirectoryError(errno.EISDIR, f"unlink {rel}: a directory (rmdir it)")
        remote.unlink(rel)
        self.changed(rel, None, False)

    def _staged_under(self, rel: str) -> bool:
        with self._lock:
            return any(p.startswith(rel + "/") for p in self._staged)

    def rename(self, src: str, dst: str) -> FileInfo | None:
        """Rename `src` to `dst`, replacing a file there (DCP's and safetensors'
        pattern: write a temp file, rename it over the old one). A file being
        written here may be renamed while open (safetensors renames before
        it closes): its staged bytes are uploaded under the new name."""
        remote = self.remote()
        if src == dst:
            return None
        if not src or not dst or dst.startswith(src + "/"):
            raise OSError(errno.EINVAL, f"rename {src or '/'} to {dst or '/'}: not possible")
        with self._lock:
            held = self._staged.get(src)
            busy = dst in self._staged
        if busy or self._staged_under(src):
            raise OSError(errno.EBUSY, f"rename {src} to {dst}: {dst} or a file under {src} "
                                       f"is being written here; close it first")
        self._check_parent(dst, "rename")
        target = self._stat(dst)
        if held is not None:
            if target is not None and target.is_dir:
                raise IsADirectoryError(errno.EISDIR, f"rename {src} to {dst}: a directory")
            return self._rename_staged(held, src, dst)
        old = self._stat(src)
        if old is None:
            raise FileNotFoundError(errno.ENOENT, f"rename {src}: not in {self.backend.source}")
        if old.is_dir:
            if not remote.renames_dirs:
                raise OSError(errno.EXDEV, f"rename {src}: a directory, which "
                                           f"{self.backend.source} cannot rename in one step "
                                           f"(mv copies it)")
            if target is not None and not target.is_dir:
                raise NotADirectoryError(errno.ENOTDIR, f"rename {src} to {dst}: not a "
                                                        f"directory")
        elif target is not None and target.is_dir:
            raise IsADirectoryError(errno.EISDIR, f"rename {src} to {dst}: a directory")
        new = remote.rename(src, dst, old)
        self.changed(src, None, old.is_dir)
        self.changed(dst, new if not old.is_dir else None, old.is_dir)
        if new is not None and not old.is_dir:
            self.written.renamed(old, new)
        return new

    def _rename_staged(self, held: _Held, src: str, dst: str) -> FileInfo | None:
        """Rename a file being written here: what it uploaded before (an
        fsync) is renamed in the remote; its staged bytes go to `dst` at
        its next commit."""
        f = held.file
        new = None
        with f.lock:
            old = self._stat(src) if held.info is not None else None
            if old is not None and not old.is_dir:
                new = self.remote().rename(src, dst, old)
            with self._lock:
                if self._staged.get(src) is held:
                    del self._staged[src]
                self._staged[dst] = held
            f.rel = dst
        self.changed(src, None, False)
        self.changed(dst, new, False)
        return new


class WriteHandle:
    """One open of a staged file: writes at offsets, reads of its own bytes,
    truncate, `commit` (fsync), `close` (commit, then release)."""

    def __init__(self, writes: Writes, held: _Held):
        self._writes = writes
        self._held = held
        self.rel = held.file.rel
        self.closed = False

    @property
    def size(self) -> int:
        return self._held.file.size

    @property
    def path(self) -> str:
        """Where the file goes (a rename while open moves it)."""
        return self._held.file.rel

    @property
    def staged(self) -> StagedFile:
        return self._held.file

    def write(self, offset: int, data) -> int:
        held = self._held
        n = held.file.write(offset, data)
        self._writes.counters.add("staged_bytes", n)
        if not held.unlinked:
            held.stream.advance(offset + n)
        return n

    def read(self, offset: int, size: int) -> bytearray:
        return self._held.file.read(offset, size)

    def truncate(self, size: int) -> None:
        self._held.file.truncate(size)

    def commit(self) -> FileInfo | None:
        """Upload now if changed (fsync); the FileInfo of the new version."""
        if self.closed:
            raise ValueError(f"write handle of {self.rel} is closed")
        return self._writes.commit(self._held)

    def close(self) -> FileInfo | None:
        """`commit`, then `release` (also when the commit fails: the staged
        bytes are dropped, and the error raised)."""
        if self.closed:
            return self._held.info
        try:
            return self.commit()
        finally:
            self.release()

    def release(self) -> None:
        """Let go of the staged file without uploading (its last handle drops it)."""
        if not self.closed:
            self.closed = True
            self._writes.release(self._held)
