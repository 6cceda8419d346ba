"""Single-flight: concurrent callers asking for one key run the work once.

The first caller (the leader) runs the function; callers arriving while it
runs wait for its result or exception. Once the leader finishes, the key is
forgotten, so a later call runs the work again (results are cached elsewhere,
in `memory`). Not shared across fork: a child builds its own instance.

A leader whose work also produces other keys' values (one ranged read that
brings several blocks) `claim`s those keys first, so callers asking for them
wait instead of fetching them again, and `settle`s each claim when done; a
claim must always be settled (value, error, or `RETRY`: the leader will not
bring it after all, and each waiter calls again, one of them leading), or
its waiters wait forever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

RETRY = object()  # a claim's value: its leader gave it up; ask again


class _Call:
    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class SingleFlight:
    """Deduplicate concurrent calls per key inside one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, _Call] = {}

    def do(self, key: str, fn: Callable[[], Any]) -> tuple[Any, bool]:
        """Return (fn's result, whether this caller ran it)."""
        while True:
            with self._lock:
                call = self._calls.get(key)
                leader = call is None
                if leader:
                    call = self._calls[key] = _Call()
            if leader:
                break
            call.done.wait()
            if call.error is not None:
                raise call.error
            if call.value is not RETRY:
                return call.value, False
        try:
            value = fn()
        except BaseException as exc:
            self.settle(key, call, error=exc)
            raise
        self.settle(key, call, value)
        return value, True

    def claim(self, key: str) -> _Call | None:
        """Lead `key` by hand: a claim to `settle` later, or None if another
        caller leads it already."""
        with self._lock:
            if key in self._calls:
                return None
            call = self._calls[key] = _Call()
            return call

    def settle(self, key: str, call: _Call, value: Any = None,
               error: BaseException | None = None) -> None:
        """End a claim: its waiters get `value` (or `error` raised), and the key
        is forgotten."""
        call.value, call.error = value, error
        with self._lock:
            del self._calls[key]
        call.done.set()

    def busy(self, key: str) -> bool:
        """Whether someone leads `key` now (a hint: it may end at once)."""
        return key in self._calls
