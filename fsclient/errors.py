"""How the mount answers errors: every handler raises FuseError and nothing else.

The session answers any other exception with EIO too, but only a handler knows
which file a request was about, so `fuse_op` turns every exception into an errno
here. A volume error keeps its errno only when it says something true about the
file or the request; anything else (a timeout, a refused connection, a remote
5xx after the retry budget) is the remote failing: EIO, as a disk error would
be, with the real cause logged once per file (`EioLog`).
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from .session import FuseError

log = logging.getLogger(__name__)


class RequestOwner(Protocol):
    """What `fuse_op` needs of the file system whose handlers it wraps."""

    eio_log: EioLog

    def path_of_request(self, op: str, args: tuple) -> str: ...


_KEPT_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                          errno.ESTALE, errno.EINVAL, errno.ENAMETOOLONG,
                          # a writable mount's: staging full, a file written in
                          # place, a rename of a file being written or of a
                          # directory on S3, names taken or not empty, a source
                          # that takes no writes
                          errno.ENOSPC, errno.EOPNOTSUPP, errno.EBUSY, errno.EXDEV,
                          errno.EEXIST, errno.ENOTEMPTY, errno.EROFS})
_EIO_LOGGED_MAX = 4096  # files whose EIO cause was logged, before starting over


def errno_of(exc: BaseException, gone: int = errno.ENOENT) -> int:
    """The errno a volume exception maps to; `gone` for a missing file,
    EIO for every error that is not about the file itself."""
    if isinstance(exc, FileNotFoundError):
        return gone
    if isinstance(exc, PermissionError):
        return errno.EACCES
    if isinstance(exc, OSError) and exc.errno in _KEPT_ERRNOS:
        return exc.errno
    return errno.EIO


def fuse_op(gone: int = errno.ENOENT) -> Callable:
    """Decorate a handler so that it only ever raises FuseError."""

    def wrap(fn: Callable) -> Callable:
        name = fn.__name__

        @functools.wraps(fn)
        def handler(self: RequestOwner, *args: Any) -> Any:
            try:
                return fn(self, *args)
            except FuseError:
                raise
            except OSError as exc:
                code = errno_of(exc, gone)
                if code == errno.EIO:
                    self.eio_log.warn(name, self.path_of_request(name, args), exc)
                else:
                    log.debug("%s%r: %s", name, args[:2], exc)
                raise FuseError(code) from None
            except Exception:
                log.exception("%s%r failed; answering EIO", name, args[:2])
                raise FuseError(errno.EIO) from None
        return handler

    return wrap


class EioLog:
    """Logs the real cause of an EIO answer once per file: a failing remote
    would otherwise log every 128 KiB read of every file."""

    __slots__ = ("_logged",)

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def warn(self, op: str, path: str, exc: OSError) -> None:
        if path in self._logged:
            log.debug("%s %s: %s (answering EIO)", op, path, exc)
            return
        if len(self._logged) >= _EIO_LOGGED_MAX:
            self._logged.clear()  # bounded; a file may then be logged again
        self._logged.add(path)
        log.warning("%s %s failed (%s); answering EIO", op, path or "/", exc)
