"""S3 writes through s3fs: one PUT, multipart uploads, copy then delete, directory markers.

Every request is one `Backend.call` (bounded by the volume's timeout, retried
while failures are temporary) of s3fs's `_call_s3`, so the filesystem's own
options apply (credentials, endpoint, `s3_additional_kwargs` such as SSE);
but the bulk, each PutObject and UploadPart, is sent by `s3direct` where it
may stand in for s3fs (its rules: no SSE arguments, no proxy...), signed
without hashing the body and guarded by a CRC32 S3 checks, back to s3fs for
a request it declines.

- **An object appears whole or not at all.** S3 makes a PUT's,
  a CompleteMultipartUpload's and a CopyObject's object visible at once, in
  one piece. An upload that fails is aborted (AbortMultipartUpload); if the
  abort fails too (the server went away) its parts stay, never visible as an
  object, until the bucket's AbortIncompleteMultipartUpload lifecycle rule
  drops them (docs/deploy.md).
- **Rename is a copy, then a delete.** CopyObject to the new key (up to
  5 GiB in one request; larger through s3fs's managed copy), then
  DeleteObject of the old key. From the copy's end to the delete's both
  names hold the whole object (a crash there leaves both), and a reader of
  either gets one whole object: each key only ever changes by a whole
  object replacing another, never by bytes being written in place.
- **Directories are markers.** S3 has none: `mkdir` puts the empty object
  `dir/` (as s3fs and the console do), so an empty directory exists and is
  listed; `rmdir` deletes it once nothing else is under the prefix. A
  directory that was only implied by its keys gets its marker before its
  last file is unlinked or renamed away (`keep_parent`): it stays, as on a
  local disk, until `rmdir`.
- **The version written is the version cached.** A PUT or a completed
  upload answers the new ETag; a HEAD right after gives the FileInfo the
  reader's metadata will see, if it holds that ETag (another writer may
  have replaced the object meanwhile: then ours is described from what
  we know). A managed copy answers no ETag: None (nothing is cached for it).
"""

from __future__ import annotations

import errno
import logging
import threading
import time

from fsspec.asyn import sync

from . import s3direct
from .backend import Backend
from .fileinfo import FileInfo
from .s3direct import Declined, DirectS3

log = logging.getLogger(__name__)

MIN_PART = 5 << 20           # S3's smallest part but the last
COPY_LIMIT = 5 << 30         # CopyObject's largest object


def body(data: memoryview) -> bytes | bytearray:
    """What botocore takes as a Body: the buffer `data` views when it is the
    whole of one (a part's buffer), else a copy (the last, shorter part)."""
    whole = data.obj
    if isinstance(whole, (bytes, bytearray)) and len(whole) == data.nbytes:
        return whole
    return data.tobytes()


class S3Writes:
    """The writes of one volume on S3 (see the module doc). Thread-safe."""

    min_part = MIN_PART
    renames_dirs = False

    def __init__(self, backend: Backend, parallel: int = 16):
        self.backend = backend
        self.fs = backend.fs
        self.direct: DirectS3 | None = (s3direct.direct_reader(self.fs, backend.timeout, parallel)
                                        if s3direct.switched_on() else None)

    def _key(self, rel: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.backend.full_path(rel))
        return bucket, key

    def call(self, what: str, rel: str, method: str, **kwargs) -> dict:
        """One S3 request through s3fs, as a `Backend.call`."""
        fs = self.fs
        return self.backend.call(what, rel, lambda **tkw: sync(
            fs.loop, fs._call_s3, method, **kwargs, **tkw))

    def written(self, rel: str, etag: str, size: int) -> FileInfo:
        """The FileInfo of the object just written with `etag`: a HEAD's, if
        it still shows that ETag; else ours, as written."""
        etag = etag.strip('"')
        try:
            info = self.backend.stat(rel)
        except OSError as exc:
            log.info("HEAD of %s after writing it failed (%s)", rel, exc)
        else:
            if info.version == etag and not info.is_dir:
                return info
        return FileInfo(path=rel, name=rel.rpartition("/")[2], size=size, is_dir=False,
                        is_link=False, mtime_ns=time.time_ns(), version=etag)

    def send(self, rel: str, data: memoryview, **where) -> str:
        """PutObject (no `where`), or UploadPart (UploadId, PartNumber); the ETag."""
        bucket, key = self._key(rel)
        direct = self.direct
        if direct is not None:
            query = ({"partNumber": str(where["PartNumber"]), "uploadId": where["UploadId"]}
                     if where else None)
            def put(**tkw) -> str | Declined:
                try:
                    return direct.put(bucket, key, data, query)
                except Declined as exc:  # (s3fs asks, and says what S3 meant)
                    return exc
            got = self.backend.call("upload", rel, put)
            if not isinstance(got, Declined):
                return got
            if got.permanent:
                self.direct = None
            log.info("a PUT of %s goes through s3fs: %s", rel, got)
        method = "upload_part" if where else "put_object"
        return self.call("upload", rel, method, Bucket=bucket, Key=key, Body=body(data),
                         **where)["ETag"]

    def put(self, rel: str, data: memoryview) -> FileInfo:
        return self.written(rel, self.send(rel, data), len(data))

    def begin(self, rel: str) -> MultipartUpload:
        bucket, key = self._key(rel)
        answer = self.call("upload", rel, "create_multipart_upload", Bucket=bucket, Key=key)
        return MultipartUpload(self, rel, bucket, key, answer["UploadId"])

    def mkdir(self, rel: str) -> None:
        bucket, key = self._key(rel)
        self.call("mkdir", rel, "put_object", Bucket=bucket, Key=key + "/", Body=b"")

    def rmdir(self, rel: str) -> None:
        if self.backend.listdir(rel):
            raise OSError(errno.ENOTEMPTY, f"rmdir {rel}: directory not empty in "
                                           f"{self.backend.source}")
        bucket, key = self._key(rel)
        self.call("rmdir", rel, "delete_object", Bucket=bucket, Key=key + "/")

    def unlink(self, rel: str) -> None:
        bucket, key = self._key(rel)
        self.keep_parent(rel)
        self.call("unlink", rel, "delete_object", Bucket=bucket, Key=key)

    def keep_parent(self, rel: str) -> None:
        """Put the marker of `rel`'s directory unless it has one (see the module doc)."""
        parent = rel.rpartition("/")[0]
        if not parent:
            return
        bucket, key = self._key(parent)
        try:
            self.call("stat", parent, "head_object", Bucket=bucket, Key=key + "/")
        except FileNotFoundError:
            self.call("mkdir", parent, "put_object", Bucket=bucket, Key=key + "/", Body=b"")

    def rename(self, src: str, dst: str, old: FileInfo) -> FileInfo | None:
        """Copy `src` to `dst`, then delete `src`. The new name's FileInfo
        only if the copy is of `old`'s version: asked of S3 (CopySourceIfMatch:
        S3 refuses the copy of another version; not every S3-compatible
        server checks it), and checked after (`src` still that version)."""
        (bucket, key), (dbucket, dkey) = self._key(src), self._key(dst)
        info = None
        if old.size <= COPY_LIMIT:
            answer = self.call("rename", src, "copy_object", Bucket=dbucket, Key=dkey,
                               CopySource={"Bucket": bucket, "Key": key},
                               CopySourceIfMatch=f'"{old.version}"')
            etag = (answer.get("CopyObjectResult") or {}).get("ETag")
            info = self.written(dst, etag, old.size) if etag else None
        else:  # UploadPartCopy in parts, by s3fs
            full, dfull, fs = self.backend.full_path(src), self.backend.full_path(dst), self.fs
            self.backend.call("rename", src, lambda **tkw: fs.copy(full, dfull, **tkw))
        if info is not None and self.backend.stat(src).version != old.version:
            info = None  # changed around the copy: which version was copied is unknown
        self.keep_parent(src)
        try:
            self.call("rename", src, "delete_object", Bucket=bucket, Key=key)
        except OSError as exc:
            raise OSError(errno.EIO, f"rename {src} to {dst}: copied, but {src} could not be "
                                     f"deleted, so both names hold it: {exc}") from None
        return info


class MultipartUpload:
    """One multipart upload: `part` from any thread, then `complete` or `abort`."""

    def __init__(self, writes: S3Writes, rel: str, bucket: str, key: str, upload_id: str):
        self._writes = writes
        self._rel = rel
        self._where = {"Bucket": bucket, "Key": key, "UploadId": upload_id}
        self._etags: dict[int, str] = {}
        self._lock = threading.Lock()

    def part(self, number: int, offset: int, data: memoryview) -> None:
        etag = self._writes.send(self._rel, data, PartNumber=number,
                                 UploadId=self._where["UploadId"])
        with self._lock:
            self._etags[number] = etag

    def complete(self, size: int, parts: int) -> FileInfo:
        listed = [{"PartNumber": n, "ETag": e} for n, e in sorted(self._etags.items())
                  if n <= parts]
        answer = self._writes.call("upload", self._rel, "complete_multipart_upload",
                                   MultipartUpload={"Parts": listed}, **self._where)
        return self._writes.written(self._rel, answer["ETag"], size)

    def abort(self) -> None:
        try:
            self._writes.call("upload", self._rel, "abort_multipart_upload", **self._where)
        except Exception as exc:  # noqa: BLE001 - the caller is failing already
            log.warning("could not abort the upload of %s (%s): its parts stay until the "
                        "bucket's AbortIncompleteMultipartUpload rule removes them",
                        self._rel, exc)
