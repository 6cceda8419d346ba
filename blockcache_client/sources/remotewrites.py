"""Writing a volume's remote: whole objects, and the metadata changes checkpoint writers make.

What a writer may ask of a source (`RemoteWrites`):
- an upload (`begin`): parts of one file given in any order, on any threads
  (`Upload.part`), then `complete`, at which moment the object appears
  whole, or `abort`, after which nothing of it is visible. S3 (`s3writes`):
  a multipart upload, or one PUT (`put`); a local directory (`localwrites`):
  a temp file beside the target, renamed over it. Either way a reader of
  the name sees the old object or the new one, never a part of one;
- `mkdir`, `rmdir` (of an empty directory), `unlink` (of a file), `rename`
  (of a file: on S3 a copy then a delete, see `s3writes`).

Each returns what the reader's metadata will see of the new name: its
`FileInfo` (the version block keys derive from), or None where the source
cannot say without a race (then nothing is cached under a guess).

Only S3 (s3fs) and local directories can be written: `writes_for` refuses
any other source, naming it, when a volume is made writable.
"""

from __future__ import annotations

import errno
from typing import Protocol

from .backend import Backend
from .fileinfo import FileInfo


class Upload(Protocol):
    """One object being written: parts, then complete or abort."""

    def part(self, number: int, offset: int, data: memoryview) -> None:
        """Part `number` (1, 2, ...: in the order of the file) of the object,
        its bytes at `offset` of the file. Thread-safe."""

    def complete(self, size: int, parts: int) -> FileInfo | None:
        """Make the object of `size` bytes, parts 1..`parts`, visible, whole;
        its FileInfo (a part sent with a higher number is left out)."""

    def abort(self) -> None:
        """Drop what was sent; never raises."""


class RemoteWrites(Protocol):
    """The writes one volume's source takes (see the module doc)."""

    min_part: int  # the smallest part but the last one the source takes
    renames_dirs: bool  # rename takes a directory (local), or only files (S3)

    def put(self, rel: str, data: memoryview) -> FileInfo | None: ...

    def begin(self, rel: str) -> Upload: ...

    def mkdir(self, rel: str) -> None: ...

    def rmdir(self, rel: str) -> None: ...

    def unlink(self, rel: str) -> None: ...

    def rename(self, src: str, dst: str, old: FileInfo) -> FileInfo | None:
        """Rename the file or directory `src` (`old`, as stat-ed just now);
        the new name's FileInfo only if it is known to hold `old`'s bytes."""


def writes_for(backend: Backend) -> RemoteWrites:
    """The writes `backend`'s source takes; OSError(EROFS) naming the source
    where it takes none (any source but S3 through s3fs and local directories)."""
    if backend.kind == "s3":
        from .s3writes import S3Writes
        return S3Writes(backend)
    if backend.kind == "local":
        from .localwrites import LocalWrites
        return LocalWrites(backend)
    raise OSError(errno.EROFS, f"source {backend.source} cannot be written: writable "
                               f"volumes need an S3 (s3://) or local directory source")
