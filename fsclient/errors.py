"""How the mount answers errors: every handler raises FUSEError and nothing else.

pyfuse3 ends its main loop on any exception other than FUSEError, which would
kill the mount, so `fuse_op` turns every exception into an errno. A volume
error keeps its errno only when it says something true about the file or the
request; anything else (a timeout, a refused connection, a remote 5xx after
the retry budget) is the remote failing: EIO, as a disk error would be, with
the real cause logged once per file (`EioLog`).
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyfuse3

if TYPE_CHECKING:
    from .fs import BlockcacheFS

log = logging.getLogger("fsclient.fs")

_KEPT_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                          errno.ESTALE, errno.EINVAL, errno.ENAMETOOLONG})
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
    """Decorate a handler so that it only ever raises FUSEError; count it and
    time it (when the mount's metrics are on)."""

    def wrap(fn: Callable) -> Callable:
        name = fn.__name__

        @functools.wraps(fn)
        async def handler(self: BlockcacheFS, *args: Any) -> Any:
            self.ops[name] += 1
            timed = self.op_latency
            start = time.perf_counter() if timed is not None else 0.0
            try:
                return await fn(self, *args)
            except pyfuse3.FUSEError:
                raise
            except OSError as exc:
                code = errno_of(exc, gone)
                if code == errno.EIO:
                    self.eio_log.warn(name, self.path_of_request(name, args), exc)
                else:
                    log.debug("%s%r: %s", name, args[:2], exc)
                raise pyfuse3.FUSEError(code) from None
            except Exception:
                log.exception("%s%r failed; answering EIO", fn.__name__, args[:2])
                raise pyfuse3.FUSEError(errno.EIO) from None
            finally:
                if timed is not None:
                    timed.observe(name, time.perf_counter() - start)
        return handler

    return wrap


def erofs(fn: Callable) -> Callable:
    """A write handler of this read-only file system: always EROFS."""
    @functools.wraps(fn)
    async def handler(self: Any, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)
    return handler


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
