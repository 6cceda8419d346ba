"""`Volume`'s write face: `open(path, "wb")`, `open_staged`, mkdir, rmdir, unlink, rename.

The writes themselves are the writer room's (`writer.writes.Writes`: staged
files, one upload on close, the metadata changes); this part builds them
for each process (`_start_writes`, from `Volume._start_process`: a forked
child drops what its parent had staged) and keeps the volume's metadata
cache true to them: after each change the path (and its parent's listing)
is answered from the source again, or from what the upload returned, so
an open right after a close in this process sees the new version
(close-to-open), and so does an open on this host's other mounts of the
volume (`writer.stamps`, `written_here`). What was uploaded is put in the
host's cache in the background (`writer.written`); `wait_fills` waits for
that too.
"""

from __future__ import annotations

import errno

from ..contract.errors import ConfigError
from ..sources.fileinfo import FileInfo, normalize
from ..writer.stamps import Stamps
from ..writer.writefile import MODES, WriteFile
from ..writer.writes import OVERWRITE_HINT, WriteHandle, Writes
from ..writer.written import WrittenBlocks


class VolumeWrites:
    """The write methods `Volume` has (a mixin over its per-process parts)."""

    def _start_writes(self) -> None:
        # the closures hold the parts, never the Volume: the writer's thread
        # must not keep a dropped Volume alive
        name, names, block_size, hits = self.name, self.names, self.block_size, self._hits

        def key_prefix(rel: str, version: str) -> str:
            return names.file_prefix(name, rel, version, block_size)

        def cached(key: str, length: int):
            return hits.read(key, length, 0, length, None)
        written = WrittenBlocks(block_size, key_prefix, self._link, cached)
        # (`_key_prefix` caches each path's prefix: an open checks its stamp)
        self._stamps = Stamps(self._key_prefix, self._volume_key, self._chunk_size,
                              self.socket_path, self._daemon_uid, cached)
        self._writes = Writes(name, self.backend, self._volume_key, self._chunk_size,
                              self.counters, written, self._meta.changed,
                              self._write_options, self._stamps)

    def check_writable(self) -> None:
        """ConfigError now, naming the fix, if writes to this volume cannot
        work: a source that takes none, or no staging directory (a writable
        mount checks this at start, rather than at its first write)."""
        self._proc()
        try:
            self._writes.remote()
        except OSError as exc:
            raise ConfigError(f"volume {self.name}: {exc.strerror or exc}") from None
        self._writes.area()

    def _open_write(self, path: str, mode: str) -> WriteFile:
        if mode in ("r+b", "rb+", "ab", "a+b", "ab+"):
            raise OSError(errno.EOPNOTSUPP, f"open {path} {mode!r}: {OVERWRITE_HINT}")
        if mode not in MODES:
            raise ValueError(f"open {path}: mode {mode!r}; a volume file opens 'rb' to read, "
                             f"or 'wb' / 'w+b' to write (staged, uploaded whole on close)")
        return WriteFile(self.open_staged(path), mode)

    def open_staged(self, path: str, truncate: bool = True,
                    checked: bool = False) -> WriteHandle:
        """A handle writing `path` at offsets, for a caller that keeps its own
        positions (the FUSE client): see `writer.writes`. `truncate`: O_TRUNC
        (else an existing non-empty file is refused, EOPNOTSUPP); `checked`:
        the caller knows the path is no directory and its parent is one."""
        self._proc()
        return self._writes.open(normalize(path), truncate, checked)

    def staged_size(self, path: str) -> int | None:
        """The size of `path` as staged by an open write handle in this
        process, or None if none is open (its size is the remote's)."""
        staged = self._writes.staged(normalize(path))
        return staged.size if staged is not None else None

    def written_here(self, path: str) -> tuple[FileInfo | None, int] | None:
        """What a writer on this host last made of `path`, if its stamp is in
        the host cache: (the FileInfo it uploaded, None if it removed the
        file; when, in wall-clock ns). Read as a hit: no round trip, never
        the source (`writer.stamps`)."""
        self._proc()
        key = self._stamps.known(path)  # (a path asked for before is canonical)
        return self._stamps.read(path if key else normalize(path), key)

    def mkdir(self, path: str) -> None:
        """Make a directory (EEXIST if the name is taken)."""
        self._proc()
        self._writes.mkdir(normalize(path))

    def rmdir(self, path: str) -> None:
        """Remove an empty directory (ENOTEMPTY otherwise)."""
        self._proc()
        self._writes.rmdir(normalize(path))

    def unlink(self, path: str) -> None:
        """Remove a file (EISDIR for a directory)."""
        self._proc()
        self._writes.unlink(normalize(path))

    def rename(self, src: str, dst: str) -> None:
        """Rename a file, replacing a file at `dst` (S3: a copy, then a delete:
        see `sources.s3writes`); its cached blocks follow it. A file being
        written in this process may be renamed while open: it is uploaded
        under the new name when closed."""
        self._proc()
        self._writes.rename(normalize(src), normalize(dst))
