"""One large read of a cached block: its chunks read and decrypted on every core at once.

A warm sequential reader (a checkpoint load, a shard stream) is bound by
AES-GCM and by copying the ciphertext out of the page cache: one 1 MiB
read is sixteen 64 KiB chunks, each independent. A read of at least
`PARALLEL_MIN` bytes is cut at chunk boundaries into units of
`UNIT_CHUNKS` chunks, taken in turn by the caller's thread and by idle
helper threads. Each unit is one `pread` of its ciphertext into the taking
thread's own buffer (kept in its L2 cache, and the copy out of the page
cache runs in parallel too), then its chunks opened straight into their
part of the destination (the caller's buffer, or the plaintext scratch
`read`'s bytes are copied from once) with `cryptography`'s `decrypt_into`,
which lets go of the GIL while it decrypts a chunk.

Hand-offs: a read wakes only helpers that are idle (each sleeps on a lock
of its own), at most one per unit beyond the caller's, with one wake-up
each; there is no queue. The caller never waits for a helper that has not
started: once it has taken every unit, it takes back a helper still asleep
(the helper, waking, finds nothing to do) and waits only for units under
way. On a busy host a helper's wake-up can take longer than the whole read.

Memory: one unit buffer per helper and per reading thread at a time
(`UNIT_CHUNKS` chunks and a page, ~260 KiB), so at most (helpers +
readers) x 260 KiB, counted in `stats()["decrypt_buffer_bytes"]`; no buffer
of the whole read.

Errors: a unit that fails authentication, a short read (a file truncated
under the reader) or an I/O error is raised once every unit is done, and the
whole destination is zeroed first (AES-GCM writes plaintext before it
checks the tag: no unauthenticated byte stays).

Smaller reads, one core: the caller alone, unit by unit. Helpers are per
process (a forked child builds its own) and cost nothing idle; `close`
stops them.
"""

from __future__ import annotations

import os
import threading

from ...common.aligned import PAGE, aligned
from ...contract.blockfile import HEADER_SIZE, TAG_SIZE, BlockCipher, chunk_span
from ...contract.errors import FormatError

PARALLEL_MIN = 256 << 10   # smaller reads: the hand-off would cost more than it saves
UNIT_CHUNKS = 4            # chunks a thread takes at a time (256 KiB of 64 KiB chunks)
MAX_THREADS = 32
_BUFFERS_KEPT = 8          # idle unit buffers of reading threads kept for reuse


def default_threads() -> int:
    """Threads a read's chunks are shared over: the cores this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


class _Read:
    """One read's units, shared by the caller and the helpers it woke."""

    __slots__ = ("units", "cipher", "fd", "out", "busy", "done", "error")

    def __init__(self, units, cipher: BlockCipher, fd: int, out: memoryview):
        self.units = units      # an iterator: next() on it is atomic under the GIL
        self.cipher = cipher
        self.fd = fd
        self.out = out
        self.busy = 0           # helpers working on it (under the pool's lock)
        self.done: threading.Lock | None = None  # released by the last busy helper
        self.error: BaseException | None = None

    def run(self, buf: memoryview) -> None:
        """Take units until none is left: each one pread, then decrypted into `out`."""
        cipher, fd, out = self.cipher, self.fd, self.out
        try:
            for index, end, start, length, p0, p1 in self.units:
                k = start % PAGE  # where the page cache has it (see common/aligned)
                got = os.preadv(fd, [buf[k:k + length]], start)
                if got != length:
                    raise FormatError(f"block file is shorter than its header says ({got} "
                                      f"bytes at {start} where {length} belong)")
                cipher.open_into(index, end, buf[k:k + length], out[p0:p1])
        except BaseException as exc:  # noqa: BLE001 - raised by the caller, once all are done
            if self.error is None:
                self.error = exc
            for _ in self.units:  # nobody takes the rest: the read has failed
                pass


class _Helper:
    """A thread that sleeps on its own lock until a read gives it work."""

    __slots__ = ("wake", "read", "started", "buf", "thread")

    def __init__(self, unit_bytes: int):
        self.wake = threading.Lock()
        self.wake.acquire()     # released to wake it
        self.read: _Read | None = None
        self.started = False
        self.buf = aligned(unit_bytes)
        self.thread: threading.Thread | None = None


class ParallelDecrypt:
    """Reads and opens a large read's chunks over `threads` threads (the caller's included)."""

    def __init__(self, threads: int | None = None, chunk_size: int = 64 << 10):
        self.threads = default_threads() if threads is None else max(1, int(threads))
        self.enabled = self.threads > 1
        # a unit's ciphertext, placed at its file offset's place in a page
        self.unit_bytes = UNIT_CHUNKS * (chunk_size + TAG_SIZE) + PAGE
        self._lock = threading.Lock()
        self._idle: list[_Helper] = []
        self._helpers = 0        # started (idle or busy)
        self._buffers: list[memoryview] = []  # reading threads' idle unit buffers
        self._buffers_made = 0
        self._closed = False
        self.parallel_reads = 0  # reads shared over threads (stats)

    # -- the read ---------------------------------------------------------------

    def read_file_into(self, cipher: BlockCipher, fd: int, offset: int, out: memoryview
                       ) -> None:
        """Plaintext [offset, offset + len(out)) of the block file open at `fd`
        (its size already checked against its header) stored in `out`.
        IntegrityError, FormatError (short file) or OSError: `out` is zeroed."""
        n = len(out)
        csize = cipher.chunk_size
        step = csize + TAG_SIZE
        blen = cipher.plaintext_len
        first, end = chunk_span(blen, csize, offset, n)
        head = first * csize < offset                   # cut by the read's start
        tail = offset + n < min(end * csize, blen)      # cut by its end
        a, b = first + head, end - tail                 # the whole chunks: [a, b)
        # threads worth waking: a unit of whole chunks each, at least
        k = min(self.threads, -(-(b - a) // UNIT_CHUNKS)) if n >= PARALLEL_MIN else 1
        units = []
        lo = a
        while lo < b:
            # units shrink toward the end (a share of what is left), so the
            # threads finish together: the caller waits less for the last one
            hi = min(b, lo + (min(UNIT_CHUNKS, -(-(b - lo) // (2 * k))) if k > 1 else
                              UNIT_CHUNKS))
            p1 = min(hi * csize, blen) - offset
            units.append((lo, hi, HEADER_SIZE + lo * step, p1 + offset - lo * csize
                          + (hi - lo) * TAG_SIZE, lo * csize - offset, p1))
            lo = hi
        read = _Read(iter(units), cipher, fd, out)
        woken = self._wake(read, k - 1) if k > 1 else ()
        buf = self._take_buffer()
        try:
            if head or tail:  # cut chunks: whole into the unit buffer, the part kept
                try:
                    self._cut(read, buf, first, head, tail, b, offset, n, step)
                except BaseException as exc:  # noqa: BLE001 - raised below
                    read.error = read.error or exc
            read.run(buf)
        finally:
            self._give_buffer(buf)
            if woken:
                self._settle(read, woken)
        if read.error is not None:
            if not out.readonly:  # (a read-only destination fails before any plaintext)
                out[:] = bytes(n)
            raise read.error

    def _cut(self, read: _Read, buf: memoryview, first: int, head: bool, tail: bool, b: int,
             offset: int, n: int, step: int) -> None:
        cipher, csize, blen = read.cipher, read.cipher.chunk_size, read.cipher.plaintext_len
        cuts = [first] if head else []
        if tail and not (head and b == first):  # one chunk cut at both ends: once
            cuts.append(b)
        for index in cuts:
            length = min(step, blen - index * csize + TAG_SIZE)
            start = HEADER_SIZE + index * step
            k = start % PAGE
            got = os.preadv(read.fd, [buf[k:k + length]], start)
            if got != length:
                raise FormatError(f"block file is shorter than its header says ({got} "
                                  f"bytes at {start} where {length} belong)")
            lo, hi = max(offset, index * csize), min(offset + n, index * csize + length
                                                     - TAG_SIZE)
            cipher.read_range_into(lo, buf[k:k + length], read.out[lo - offset:hi - offset])

    # -- helpers ----------------------------------------------------------------

    def _wake(self, read: _Read, want: int) -> list[_Helper]:
        """Give `read` to up to `want` idle helpers (starting new ones up to
        `threads` - 1); the ones woken."""
        woken = []
        with self._lock:
            if self._closed:
                return woken
            while len(woken) < want:
                if self._idle:
                    h = self._idle.pop()
                elif self._helpers < self.threads - 1:
                    h = self._start_helper()
                else:
                    break
                h.read = read
                h.started = False
                woken.append(h)
            if woken:
                self.parallel_reads += 1
        for h in woken:
            h.wake.release()
        return woken

    def _settle(self, read: _Read, woken: list[_Helper]) -> None:
        """The caller took every unit: take back the helpers not started yet,
        and wait for the units under way."""
        with self._lock:
            for h in woken:
                if h.read is read and not h.started:
                    h.read = None  # it wakes to nothing and goes back idle
            if read.busy:
                read.done = threading.Lock()
                read.done.acquire()
            done = read.done
        if done is not None:
            done.acquire()  # released by the last busy helper

    def _start_helper(self) -> _Helper:
        """A new helper thread (the caller holds the lock)."""
        h = _Helper(self.unit_bytes)
        h.thread = threading.Thread(target=self._serve, args=(h,), daemon=True,
                                    name=f"blockcache-decrypt-{self._helpers}")
        self._helpers += 1
        h.thread.start()
        return h

    def _serve(self, h: _Helper) -> None:
        while True:
            h.wake.acquire()
            with self._lock:
                read = h.read
                if self._closed:
                    return
                if read is not None:
                    h.started = True
                    read.busy += 1
                else:  # taken back before it woke
                    self._idle.append(h)
                    continue
            read.run(h.buf)
            with self._lock:
                h.read = None
                h.started = False
                read.busy -= 1
                done = read.done if not read.busy else None
                # let go before its caller wakes: held, it would keep the
                # caller's buffer exported while this helper sleeps
                read = None
                if done is not None:
                    done.release()
                if self._closed:  # after the release: its reader may be waiting
                    return
                self._idle.append(h)

    # -- reading threads' unit buffers ------------------------------------------

    def _take_buffer(self) -> memoryview:
        try:
            return self._buffers.pop()  # list pop/append are atomic: no lock
        except IndexError:
            with self._lock:
                self._buffers_made += 1
            return aligned(self.unit_bytes)

    def _give_buffer(self, buf: memoryview) -> None:
        if len(self._buffers) < _BUFFERS_KEPT:
            self._buffers.append(buf)
        else:
            with self._lock:
                self._buffers_made -= 1

    def stats(self) -> dict:
        """Threads a large read's chunks are shared over, reads so shared, and
        the bytes of the unit buffers the helpers and reading threads hold."""
        return {"decrypt_threads": self.threads if self.enabled else 1,
                "parallel_decrypt_reads": self.parallel_reads,
                "decrypt_buffer_bytes": (self._helpers + self._buffers_made) * self.unit_bytes}

    def close(self) -> None:
        """Stop the helpers (each finishes the unit it is on)."""
        with self._lock:
            self._closed = True
            helpers = list(self._idle)
            self._idle.clear()
        for h in helpers:
            h.wake.release()
