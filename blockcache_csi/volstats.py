"""statfs of a published mount with a deadline, off the gRPC workers.

A FUSE mount whose server is stopped or hung never answers statfs, and the
calling thread waits in the kernel until it does (no signal of ours ends
it). So each statvfs runs in a thread of its own, and a caller waits for it
at most `DEADLINE`: a mount that has not answered by then is abnormal, and
the thread is left to end when (if) the mount answers. At most one such
thread per target (a second call on a target whose statfs is still out
waits on the same one, or answers at once when it is already late), and at
most `MAX_OUTSTANDING` in all: a hung mount costs the kubelet's stats calls
one thread and a few seconds of one gRPC worker, never the workers that
serve publishes.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

DEADLINE = 5.0  # seconds a stats call waits for a mount's statfs
MAX_OUTSTANDING = 16  # statfs threads not yet returned, over all targets
_DEAD = (errno.ENOTCONN, errno.ECONNABORTED)


@dataclass(frozen=True)
class Usage:
    """What a stats call answers: the figures (None when the mount did not
    give any) and the volume's condition."""

    statvfs: os.statvfs_result | None
    abnormal: bool
    message: str


class _Call:
    __slots__ = ("future", "started")

    def __init__(self) -> None:
        self.future: Future = Future()
        self.started = time.monotonic()


class StatfsWithDeadline:
    """statvfs of mount points, each in a thread of its own, bounded."""

    def __init__(self, deadline: float = DEADLINE, limit: int = MAX_OUTSTANDING):
        self.deadline = deadline
        self.limit = limit
        self._out: dict[str, _Call] = {}  # target -> its statfs still running
        self._guard = threading.Lock()

    def usage(self, path: str) -> Usage:
        call = self._call(path)
        if call is None:
            return Usage(None, True, f"{self.limit} statfs calls on this node's mounts have "
                                     f"not returned; {path} was not asked (its mount or "
                                     f"another is hung)")
        late = time.monotonic() - call.started
        try:
            st = call.future.result(timeout=max(0.0, self.deadline - late))
        except FutureTimeout:
            waited = time.monotonic() - call.started
            return Usage(None, True, f"the mount at {path} has not answered statfs for "
                                     f"{waited:.0f}s: its FUSE server is stopped or hung")
        except OSError as exc:
            if exc.errno in _DEAD:
                return Usage(None, True, f"the mount at {path} is dead ({exc.strerror}): its "
                                         f"FUSE server and keeper are gone; unpublish and "
                                         f"publish it again (restart the pod)")
            return Usage(None, True, f"statfs of {path} failed: {exc.strerror}")
        return Usage(st, False, f"the mount at {path} answers")

    def outstanding(self) -> int:
        with self._guard:
            return len(self._out)

    def _call(self, path: str) -> _Call | None:
        """The statfs of `path` still out, or a new one; None when too many are."""
        with self._guard:
            call = self._out.get(path)
            if call is not None:
                return call
            if len(self._out) >= self.limit:
                return None
            call = self._out[path] = _Call()
        try:
            threading.Thread(target=self._run, args=(path, call), name="statfs",
                             daemon=True).start()
        except RuntimeError:  # no thread left to start
            with self._guard:
                self._out.pop(path, None)
            return None
        return call

    def _run(self, path: str, call: _Call) -> None:
        try:
            call.future.set_result(os.statvfs(path))
        except OSError as exc:
            call.future.set_exception(exc)
        finally:
            with self._guard:
                self._out.pop(path, None)
