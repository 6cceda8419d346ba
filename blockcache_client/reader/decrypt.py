"""One large read's chunks decrypted on every core at once, straight into its buffer.

A warm sequential reader (a checkpoint load, a shard stream) is bound by
AES-GCM: one 1 MiB read is sixteen 64 KiB chunks, each independent. Reads of
at least `PARALLEL_MIN` bytes are cut at chunk boundaries into units of
`UNIT_CHUNKS` chunks, taken in turn by the caller's thread and by pool
threads, each opened straight into its part of the destination (the
caller's buffer, or the reused plaintext scratch) with `cryptography`'s
`decrypt_into`, which lets go of the GIL while it decrypts a chunk. The
caller never waits for a pool thread that has not started yet: it takes
the units that thread would have, and its job is withdrawn (on a busy host
a pool thread's wake-up can take longer than the whole read). Nothing
is allocated per chunk, and no memory is held beyond the read's own
ciphertext buffer, so the memory budget is untouched.

Smaller reads, a read-only destination or one core: the whole read on the
caller's thread. If any slice fails authentication, the whole destination is
zeroed before IntegrityError is raised (no unauthenticated byte stays).
The pool is per process (a forked child builds its own) and idle threads
cost nothing; `close` stops it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ..contract.blockfile import TAG_SIZE, BlockCipher, chunk_span

PARALLEL_MIN = 256 << 10   # smaller reads: the hand-off would cost more than it saves
UNIT_CHUNKS = 4            # chunks a thread takes at a time (256 KiB of 64 KiB chunks)
MAX_THREADS = 32


def default_threads() -> int:
    """Threads a read's chunks are shared over: the cores this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


class ParallelDecrypt:
    """Opens a read's chunks over `threads` threads (the caller's included)."""

    def __init__(self, threads: int | None = None):
        self.threads = default_threads() if threads is None else max(1, int(threads))
        self.enabled = self.threads > 1
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.parallel_reads = 0    # reads shared over threads (stats)

    def _workers(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads - 1,
                                                    thread_name_prefix="blockcache-decrypt")
                pool = self._pool
        return pool

    def read_range_into(self, cipher: BlockCipher, offset: int, body: memoryview,
                        out: memoryview) -> None:
        """`cipher.read_range_into(offset, body, out)`, shared over threads
        where that pays (see the module doc)."""
        n = len(out)
        if not self.enabled or n < PARALLEL_MIN or out.readonly or body.readonly:
            cipher.read_range_into(offset, body, out)
            return
        csize = cipher.chunk_size
        first, end = chunk_span(cipher.plaintext_len, csize, offset, n)
        step = csize + TAG_SIZE
        # chunks cut by the read's ends go to the library on this thread
        head = first * csize < offset
        tail = offset + n < min(end * csize, cipher.plaintext_len)
        a, b = first + head, end - tail  # the whole chunks: [a, b)
        if b - a < 2:
            cipher.read_range_into(offset, body, out)
            return
        k = min(self.threads, -(-(b - a) // UNIT_CHUNKS))
        units = []
        for lo in range(a, b, UNIT_CHUNKS):
            hi = min(b, lo + UNIT_CHUNKS)
            p0 = lo * csize - offset
            p1 = min(hi * csize, cipher.plaintext_len) - offset
            units.append((lo * csize, body[(lo - first) * step:(lo - first) * step + p1 - p0
                                           + (hi - lo) * TAG_SIZE], out[p0:p1]))
        turns = iter(units)  # next() on it is atomic under the GIL: each unit opened once

        def take_turns() -> None:
            for unit in turns:
                cipher.read_range_into(*unit)
        try:
            futures = [self._workers().submit(take_turns) for _ in range(k - 1)]
        except RuntimeError:  # closing: no pool any more
            cipher.read_range_into(offset, body, out)
            return
        self.parallel_reads += 1
        errors: list[BaseException] = []
        try:
            take_turns()
            if head:
                cipher.read_range_into(offset, body[:step], out[:a * csize - offset])
            if tail:
                t0 = b * csize - offset
                cipher.read_range_into(b * csize, body[(b - first) * step:], out[t0:])
        except BaseException as exc:  # noqa: BLE001 - raised below, once the pool is done
            errors.append(exc)
        for f in futures:  # every unit ends before `out` is given back
            if f.cancel():  # not started: its units were taken here
                continue
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            out[:] = bytes(n)
            raise errors[0]

    def stats(self) -> dict:
        """Threads a large read's chunks are shared over, and reads so shared."""
        return {"decrypt_threads": self.threads if self.enabled else 1,
                "parallel_decrypt_reads": self.parallel_reads}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
