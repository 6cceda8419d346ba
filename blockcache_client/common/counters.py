"""Thread-safe event counters behind `Volume.stats()`."""

from __future__ import annotations

import threading

# the cluster tier (reader/misses/tier.py): blocks or ranges found and not found,
# item bytes received, server failures, bad items removed, fills to the tier
CLUSTER_COUNTERS = (
    "cluster_hits", "cluster_misses", "cluster_bytes", "cluster_errors", "cluster_bad",
    "cluster_fills_sent", "cluster_fills_dropped",
)
# the writer (writer/): bytes written into staged files, uploads made, their
# bytes and time, and uploads that failed (close or fsync answered EIO)
WRITE_COUNTERS = ("staged_bytes", "uploads", "uploaded_bytes", "upload_ms", "uploads_failed")
VOLUME_COUNTERS = (
    "hits", "misses", "hit_bytes", "miss_bytes", "memory_hits", "backend_bytes",
    "backend_requests", "fills_sent", "fills_dropped", "integrity_failures",
    "daemon_unavailable", "prefetches", "prefetches_dropped", "prefetches_cancelled",
    "version_checks", "chunk_hits", "evictions_refused", "cold_opens", "chunks_decrypted",
    # fetch leases (daemonclient/leases.py): blocks leased before fetching,
    # waits for another reader's fill, those that found the block cached
    # (a fetch saved), and those that did not (the block was fetched here)
    "leases_taken", "lease_waits", "lease_saved", "lease_gave_up",
    *CLUSTER_COUNTERS, *WRITE_COUNTERS,
)
PENDING_HITS = 256  # lock-free chunk hits counted before they are added up


class Counters:
    """A fixed set of named integer counters; `add` is safe from any thread."""

    __slots__ = ("_values", "_lock", "_chunk_hits")

    def __init__(self, names: tuple[str, ...] = VOLUME_COUNTERS):
        self._values = dict.fromkeys(names, 0)
        self._lock = threading.Lock()
        # bytes of chunk hits not yet added (`chunk_hit`): a list append is
        # atomic under the GIL, where the lock costs more than the hit itself
        self._chunk_hits: list[int] = []

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def add2(self, name: str, bytes_name: str, nbytes: int) -> None:
        """Count one event and its bytes under one lock (the read path's pair)."""
        with self._lock:
            self._values[name] += 1
            self._values[bytes_name] += nbytes

    def add3(self, name: str, bytes_name: str, nbytes: int, also: str) -> None:
        """`add2`, plus one more event counted, still under one lock."""
        with self._lock:
            self._values[name] += 1
            self._values[bytes_name] += nbytes
            self._values[also] += 1

    def chunk_hit(self, nbytes: int) -> None:
        """`add3("hits", "hit_bytes", nbytes, "chunk_hits")` without the lock;
        added up by the next snapshot, or here once `PENDING_HITS` wait."""
        pending = self._chunk_hits
        pending.append(nbytes)
        if len(pending) >= PENDING_HITS:
            with self._lock:
                self._add_chunk_hits()

    def _add_chunk_hits(self) -> None:
        """Move the pending chunk hits into the counters (the lock is held).
        One pop at a time, each atomic: a hit appended meanwhile stays pending."""
        pending = self._chunk_hits
        if not pending:
            return
        n = total = 0
        while pending:
            try:
                total += pending.pop()
            except IndexError:  # another thread took the last one
                break
            n += 1
        values = self._values
        values["hits"] += n
        values["hit_bytes"] += total
        values["chunk_hits"] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            self._add_chunk_hits()
            return dict(self._values)
