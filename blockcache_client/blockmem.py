"""A bounded in-memory LRU of plaintext blocks, by block key.

Why: a miss fetches a whole block (4 MiB by default) but the caller, e.g. FUSE
reading 128 KiB at a time, asks for a small piece; the next pieces must not
refetch the block while its fill is still on the way to the daemon. Bounded
by bytes; a block larger than the whole budget is simply not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class BlockMemory:
    """Thread-safe LRU: key string -> immutable block bytes, capped at `capacity` bytes."""

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self._lock = threading.Lock()
        self._blocks: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0

    def get(self, key: str) -> bytes | None:
        if not self._blocks:  # lock-free fast path for the common empty case
            return None
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.capacity:
            return
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._blocks[key] = data
            self._bytes += len(data)
            while self._bytes > self.capacity:
                _, gone = self._blocks.popitem(last=False)
                self._bytes -= len(gone)

    def discard_prefix(self, prefix: str) -> int:
        """Drop every block whose key starts with `prefix`; return how many."""
        with self._lock:
            doomed = [k for k in self._blocks if k.startswith(prefix)]
            for k in doomed:
                self._bytes -= len(self._blocks.pop(k))
            return len(doomed)

    @property
    def used(self) -> int:
        return self._bytes
