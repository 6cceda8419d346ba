"""Remote storage behind a volume, through fsspec: stat, list, ranged read, readlink.

A source is any fsspec URL: a local path or `file://`, `s3://bucket/prefix`
(storage options such as `endpoint_url`, `key`, `secret`, `client_kwargs`),
or a chained URL (`latency::file:///data`). Nothing here knows a protocol by
name; fsspec resolves the URL and this module only normalizes what comes back.
Two kinds of filesystem get more than the generic calls: S3 (s3fs), whose
ranged reads are conditional GETs sent on the caller's thread (s3direct.py),
and local files, read with fstat/pread on one descriptor.

Every call is bounded by `timeout` (on a worker thread, or by fsspec's own
loop for async filesystems), except an `inline` one: run on the caller's own
thread, for a background thread that bounds its caller's wait itself
(`prefetch_ahead`), saving two thread hand-offs per request; temporary
failures (timeouts, connection errors, throttling, 5xx) are retried with full
jitter backoff while a per-call retry budget lasts. Permanent errors (not
found, access denied, is/not a directory, bad arguments) are raised at once as
the matching OSError subclass, with the volume path in the message.

Paths are volume-relative in the one form `fileinfo.normalize` gives (no
input reaches outside the root); a listing leaves out, with a warning, an
entry whose name cannot be a path component, and keeps the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import logging
import os
import random
import time
from collections.abc import Callable

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.local import LocalFileSystem

from ..common.bufferpool import BufferPool
from . import s3direct
from .fileinfo import FileInfo, info_of, is_canonical_name, link_target
from .localfile import read_if_version
from .parts import split_parts
from .s3direct import Declined, DirectS3, direct_reader

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
DEFAULT_ATTEMPTS = 5
_BACKOFF_BASE = 0.05
_BACKOFF_CAP = 2.0
# errno values that say "asking again will not help"
_PERMANENT_ERRNOS = frozenset({
    errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EINVAL,
    errno.ENAMETOOLONG, errno.EROFS, errno.ELOOP, errno.EEXIST, errno.ENOTEMPTY,
    errno.ESTALE,
})
_PERMANENT_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError,
                    NotADirectoryError, FileExistsError, ValueError, TypeError,
                    NotImplementedError)


class Backend:
    """One volume's remote storage: `source` resolved once by fsspec."""

    def __init__(self, source: str, timeout: float = DEFAULT_TIMEOUT,
                 attempts: int = DEFAULT_ATTEMPTS, workers: int = 32,
                 fs: fsspec.AbstractFileSystem | None = None, **storage_options):
        """`fs`: an fsspec filesystem already built (e.g. the target of a chained
        URL); `source` is then the root path inside it."""
        if not isinstance(source, str) or not source:
            raise ValueError(f"volume source must be an fsspec URL or path, not {source!r}")
        self.source = source
        self._given_fs = fs
        self.timeout = float(timeout)
        self.attempts = max(1, int(attempts))
        self._workers = workers
        self._storage_options = storage_options
        # observe(what, seconds, exception or None) after each request with its
        # retries ("stat", "list", "read", "readlink"); fsclient's metrics set it
        self.observe: Callable[[str, float, BaseException | None], None] | None = None
        self._pid = -1
        self._direct: DirectS3 | None = None
        # (bucket, key prefix) of the root as s3fs splits it, and the root's
        # path with its slash: a path under it is split by appending
        self._root_key: tuple[str, str] | None = None
        self._root_slash = ""
        self._setup()

    def _setup(self) -> None:
        fs = self._given_fs
        if fs is not None:
            if self._pid != -1:  # forked: rebuild it the way fsspec pickles it
                fs = self._given_fs = type(fs)(*fs.storage_args, **fs.storage_options)
            self.fs, root = fs, fs._strip_protocol(self.source)
        else:
            try:
                self.fs, root = fsspec.core.url_to_fs(self.source, **self._storage_options)
            except (ImportError, ValueError, TypeError) as exc:
                raise ValueError(f"cannot open volume source {self.source!r}: {exc}") from None
        self.root = root.rstrip("/")
        self._async = isinstance(self.fs, AsyncFileSystem)
        # `kind`: how read_version proves a range is of one version: a conditional
        # GET (an S3 API: s3fs), fstat around a pread (local files), else a stat
        # after the read (one more round trip, any fsspec filesystem); and
        # which writes the source takes (`remotewrites`)
        if self._async and hasattr(self.fs, "_call_s3"):
            self.kind = "s3"
        elif isinstance(self.fs, LocalFileSystem):
            self.kind = "local"
        else:
            self.kind = "stat"
        # False when read_version pays a stat after its read (counted by Volume)
        self.native_versioned_reads = self.kind != "stat"
        # S3 GETs signed and sent on the reader's thread (s3direct.py); a
        # forked child keeps the parent's botocore client, not its sockets
        if self._direct is not None:  # set up again: this is a forked child
            self._direct = self._direct.for_child()
        elif self.kind == "s3" and s3direct.switched_on():
            self._direct = direct_reader(self.fs, self.timeout, self._workers)
        if self.kind == "s3":
            probe = self.full_path("x")
            bucket, key, _ = self.fs.split_path(probe)
            if bucket and key.endswith("x") and probe.endswith("/" + key):
                self._root_key, self._root_slash = (bucket, key[:-1]), probe[:-1]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self._workers, thread_name_prefix="blockcache-backend")
        self._pid = os.getpid()

    def _check_fork(self) -> None:
        # fsspec drops its instance cache in a forked child; our pool threads
        # do not exist there either.
        if self._pid != os.getpid():
            self._setup()

    def close(self) -> None:
        if self._pid == os.getpid():
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- paths -----------------------------------------------------------------

    def full_path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else (self.root or "/")

    def _rel(self, full: str) -> str:
        full = full.rstrip("/")
        root = self.root
        if root and (full == root or full.startswith(root + "/")):
            return full[len(root):].strip("/")
        # some backends return names without the protocol's leading '/'
        stripped = self.fs._strip_protocol(full).rstrip("/")
        if root and stripped.startswith(root + "/"):
            return stripped[len(root):].strip("/")
        return stripped.strip("/")

    def file_info(self, raw: dict) -> FileInfo:
        return info_of(raw, self._rel(raw["name"]))

    # -- calls -------------------------------------------------------------------

    def call(self, what: str, rel: str, fn, inline: bool = False):
        """fn(**timeout keywords), as one request to the source: bounded,
        retried while temporary failures last (`_attempts`), errors named,
        and timed for `observe` when it is set."""
        observe = self.observe
        if observe is None:
            return self._attempts(what, rel, fn, inline)
        start = time.monotonic()
        try:
            out = self._attempts(what, rel, fn, inline)
        except BaseException as exc:
            observe(what, time.monotonic() - start, exc)
            raise
        observe(what, time.monotonic() - start, None)
        return out

    def _attempts(self, what: str, rel: str, fn, inline: bool = False):
        """Run fn(**timeout_kw) with a timeout; retry temporary failures.

        An async fsspec filesystem (s3fs, gcsfs, http) already runs its I/O on
        fsspec's event loop thread and bounds the wait itself when its sync
        methods get `timeout=`; anything else runs on our worker pool, so a
        hung call (a dead NFS server) cannot hang the reader. `inline` runs
        it on this thread instead, unbounded: only for a background thread
        whose own caller gives up waiting for it after `timeout * attempts`.
        """
        self._check_fork()
        deadline = time.monotonic() + self.timeout * self.attempts
        last: BaseException | None = None
        for attempt in range(self.attempts):
            fut = None
            try:
                if self._async:
                    return fn(timeout=self.timeout)
                if inline:
                    return fn()
                fut = self._pool.submit(fn)
                return fut.result(timeout=self.timeout)
            except (concurrent.futures.TimeoutError, FSTimeoutError):
                if fut is not None:
                    fut.cancel()
                last = TimeoutError(errno.ETIMEDOUT, f"no answer within {self.timeout:g}s")
            except _PERMANENT_TYPES as exc:
                raise _named(exc, what, rel, self.source) from None
            except OSError as exc:
                if exc.errno in _PERMANENT_ERRNOS:
                    raise _named(exc, what, rel, self.source) from None
                last = exc
            except Exception as exc:  # backend libraries raise their own types
                last = exc
            pause = random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2 ** attempt))
            if attempt + 1 >= self.attempts or time.monotonic() + pause > deadline:
                break
            log.debug("%s %s failed (%s), retry %d in %.2fs", what, rel, last, attempt + 1, pause)
            time.sleep(pause)
        code = errno.ETIMEDOUT if isinstance(last, TimeoutError) else errno.EIO
        raise OSError(code, f"{what} {rel or '/'} in {self.source} failed after "
                            f"{self.attempts} attempts: {last}")

    def stat(self, rel: str, inline: bool = False) -> FileInfo:
        """Info of one entry; FileNotFoundError if it does not exist.
        `inline`: on this thread (see `_attempts`)."""
        full = self.full_path(rel)

        def info(**tkw):
            self.fs.invalidate_cache(full)  # our metadata cache decides freshness
            return self.fs.info(full, **tkw)
        raw = self.call("stat", rel, info, inline)
        fi = self.file_info(raw)
        if fi.path != rel:  # e.g. a bucket root reported under another name
            fi = dataclasses.replace(fi, path=rel, name=rel.rsplit("/", 1)[-1])
        return fi

    def listdir(self, rel: str) -> list[FileInfo]:
        """Entries of a directory, with their infos (sorted by name)."""
        full = self.full_path(rel)

        def ls(**tkw):
            self.fs.invalidate_cache(full)
            return self.fs.ls(full, detail=True, **tkw)
        raws = self.call("list", rel, ls)
        out = []
        base = rel + "/" if rel else ""
        for raw in raws:
            fi = self.file_info(raw)
            if fi.path == rel or not fi.path:  # some stores list the dir itself
                continue
            if fi.path != base + fi.name or not is_canonical_name(fi.name):
                # e.g. an S3 key with '//' or a '..' part: no path can name it
                log.warning("list %s in %s: leaving out %r, which cannot be a path "
                            "in the volume", rel or "/", self.source, raw.get("name"))
                continue
            out.append(fi)
        if not out and rel:
            # an empty listing of a name that is a file must not look like a dir
            fi = self.stat(rel)
            if not fi.is_dir:
                raise NotADirectoryError(errno.ENOTDIR, f"list {rel}: not a directory "
                                                        f"in {self.source}")
        out.sort(key=lambda f: f.name)
        return out

    def read(self, rel: str, start: int, end: int, inline: bool = False) -> bytes:
        """Bytes [start, end) of a file (fewer only at the end of the file).
        `inline`: on this thread (see `_attempts`)."""
        full = self.full_path(rel)
        if self._direct is not None:
            return b"".join(self.call("read", rel, lambda **tkw: self._s3_read(
                full, start, end, None, max(1, end - start), None, **tkw)))
        # keywords: some implementations (s3fs) take other positional arguments first
        return self.call("read", rel,
                          lambda **tkw: self.fs.cat_file(full, start=start, end=end, **tkw),
                          inline)

    @property
    def reads_first(self) -> bool:
        """`read_first` can tell a file's version with its bytes (S3 GETs sent directly)."""
        return self._direct is not None

    def read_first(self, rel: str, end: int) -> tuple[FileInfo, bytes] | None:
        """Bytes [0, end) of a file (fewer only at its end) and the FileInfo of
        the version they are, from one GET and no stat: S3's answer names its
        ETag, the object's size (Content-Range) and Last-Modified, so the
        bytes and the version cannot disagree. None where the backend does
        not answer so (no direct S3 GETs, an answer without an ETag): the
        caller stats instead. FileNotFoundError when no object has that key
        (a directory has none either: the caller's stat tells them apart)."""
        direct = self._direct
        if direct is None or end <= 0:
            return None
        bucket, key = self._bucket_key(self.full_path(rel))

        def get(**tkw):
            try:
                return direct.first(bucket, key, end)
            except Declined as exc:
                self._declined(direct, exc)
                return None
        got = self.call("read", rel, get)
        if got is None:
            return None
        data, etag, size, mtime_ns = got
        return FileInfo(path=rel, name=rel.rpartition("/")[2], size=size, is_dir=False,
                        is_link=False, mtime_ns=mtime_ns, version=etag), data

    def read_version(self, rel: str, start: int, end: int, version: str,
                     piece: int = 0, inline: bool = False,
                     buffers: BufferPool | None = None) -> bytes | list[bytes]:
        """Bytes [start, end) of `version` of a file (fewer only at its end), or
        OSError(ESTALE) naming the path if the file is no longer that version.
        With `piece` > 0: as a list of `piece`-byte parts (the last shorter),
        read straight into them where the backend allows (S3, local files):
        a coalesced read of many blocks is split without copying it again.

        S3 (s3fs): one GetObject with Range and If-Match on the ETag, which S3
        answers 412 if the object changed. Local files: fstat, pread, fstat on
        one descriptor, the version (mtime_ns-size) the same both times. Any
        other filesystem: a ranged read, then a stat (one more round trip).
        `inline`: on this thread (see `_attempts`). `buffers` (of `piece`
        bytes): S3's parts are received into them (`common.bufferpool`), each
        a read-only view of its buffer.
        """
        full = self.full_path(rel)
        step = piece if piece > 0 else max(1, end - start)
        if self.kind == "s3":
            data = self.call("read", rel, lambda **tkw: self._s3_read(
                full, start, end, version, step, buffers, **tkw))
        elif self.kind == "local":
            data = self.call("read", rel,
                             lambda **tkw: read_if_version(full, start, end, version, step),
                             inline)
        else:
            data = self.read(rel, start, end, inline)
            fresh = self.stat(rel, inline)
            if fresh.version != version:
                data = None
            else:
                data = split_parts(data, step)
        if data is None:
            raise OSError(errno.ESTALE, f"read {rel} in {self.source}: the file is no longer "
                                        f"version {version}; stat it again and retry")
        return data if piece > 0 else b"".join(data)

    def _s3_read(self, full: str, start: int, end: int, version: str | None, piece: int,
                 buffers: BufferPool | None, **tkw) -> list[bytes] | None:
        """One ranged GET (conditional on `version` unless None) in `piece`-byte
        parts, or None when S3 says the ETag no longer matches: sent directly
        (s3direct.py), or through s3fs where the direct path declines."""
        direct = self._direct
        if direct is not None:
            bucket, key = self._bucket_key(full)
            try:
                return direct.get(bucket, key, start, end, version, piece, buffers)
            except Declined as exc:
                self._declined(direct, exc)
        if version is None:
            return split_parts(self.fs.cat_file(full, start=start, end=end, **tkw), piece)
        return sync(self.fs.loop, self._s3_read_if_match, full, start, end, version, piece,
                    **tkw)

    def _declined(self, direct: DirectS3, exc: Declined) -> None:
        """The direct path declined a GET: for good, if it says so."""
        if exc.permanent and self._direct is direct:
            self._direct = None
            log.warning("S3 GETs of %s go through s3fs from now on: %s", self.source, exc)

    def _bucket_key(self, full: str) -> tuple[str, str]:
        """(bucket, key) of an S3 path, as s3fs splits it: the root once, by
        s3fs's rules (access point ARNs), then each path under it by
        appending its relative path (s3fs's split of every cold file's path
        cost ~80 us of a ~1.5 ms read)."""
        base = self._root_key
        if base is None or not full.startswith(self._root_slash) or "?versionId=" in full:
            return self.fs.split_path(full)[:2]
        return base[0], base[1] + full[len(self._root_slash):]

    async def _s3_read_if_match(self, full: str, start: int, end: int, version: str,
                                piece: int):
        """The range in `piece`-byte parts, or None when S3 says the ETag no
        longer matches (412)."""
        if end <= start:
            return []
        bucket, key, _ = self.fs.split_path(full)
        try:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                          Range=f"bytes={start}-{end - 1}",
                                          IfMatch=f'"{version}"')
        except OSError as exc:
            response = getattr(exc.__cause__, "response", None) or {}
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 412 or response.get("Error", {}).get("Code") == "PreconditionFailed":
                return None
            raise
        body = resp["Body"]
        try:
            stream = getattr(getattr(body, "raw_stream", None), "content", None)
            if type(body).__name__ != "AioStreamingBody" or not hasattr(stream, "readexactly"):
                # another body type (one that checks a checksum as it reads):
                # read it its own way
                return split_parts(await body.read(), piece)
            # each part read off the connection into its own bytes: one copy
            # of the body, where reading it whole and slicing it costs two
            parts = []
            left = end - start
            while left > 0:
                n = min(piece, left)
                try:
                    parts.append(await stream.readexactly(n))
                except asyncio.IncompleteReadError as exc:  # short: the caller judges it
                    parts.append(exc.partial)
                    break
                left -= n
            return parts
        finally:
            body.close()

    def readlink(self, rel: str) -> str:
        """Target of a symbolic link, where the backend reports one."""
        full = self.full_path(rel)
        raw = self.call("readlink", rel, lambda **tkw: self.fs.info(full, **tkw))
        if not raw.get("islink"):
            raise OSError(errno.EINVAL, f"readlink {rel}: not a symbolic link in {self.source}")
        dest = link_target(raw)
        if dest is None:
            raise OSError(errno.EINVAL, f"readlink {rel}: {self.source} does not report "
                                        f"link targets")
        return dest


def _named(exc: BaseException, what: str, rel: str, source: str) -> OSError:
    """The same kind of error, with a message naming the volume path."""
    if isinstance(exc, OSError):
        code = exc.errno
        cls = type(exc)
        reason = exc.strerror or str(exc)
    else:
        code, cls, reason = errno.EINVAL, OSError, str(exc)
        if isinstance(exc, NotImplementedError):
            code = errno.ENOTSUP
    if code is None:
        code = {FileNotFoundError: errno.ENOENT, PermissionError: errno.EACCES,
                IsADirectoryError: errno.EISDIR, NotADirectoryError: errno.ENOTDIR,
                FileExistsError: errno.EEXIST}.get(cls, errno.EIO)
    try:
        return cls(code, f"{what} {rel or '/'} in {source}: {reason}")
    except TypeError:
        return OSError(code, f"{what} {rel or '/'} in {source}: {reason}")
