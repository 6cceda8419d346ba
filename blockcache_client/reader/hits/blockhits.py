"""The hit path: a block's bytes from the memory LRU or from the cache disk.

With the layout from the daemon's `hello`, the reader opens the block file
read-only itself, checks its header and length, reads and decrypts only the
chunks the range touches, and reports the access later in a batched `touch`:
no round trip to the daemon. The ciphertext goes to a reused buffer;
`out` (the FUSE client's path) gets whole chunks decrypted straight into
the caller's buffer, else the same reused buffer is copied out once into the
bytes returned. A read of `decrypt.PARALLEL_MIN` or more is read and
decrypted unit by unit on every core instead (`decrypt`), its file's length
checked against its header first. `nowait` reads only where the kernel answers from memory
(`nowait`: openat2 RESOLVE_CACHED, preadv2 RWF_NOWAIT), so a caller that must
not wait (a FUSE worker hands its channel on first: `handle`) serves a warm
hit at once and waits only for what is not in memory.

A missing, truncated, foreign or forged block, a link or FIFO or another
uid's file at a block path, an unhealthy dir or no daemon: a miss (counted),
never an error; a bad block is evicted through the daemon and refilled.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from ...common import nowait
from ...common.aligned import PAGE, aligned
from ...common.counters import Counters
from ...common.nowait import Unsupported
from ...common.nowait import open_cached as nowait_open
from ...contract.blockfile import HEADER_SIZE, TAG_SIZE, chunk_span, file_size
from ...contract.errors import FormatError, IntegrityError
from ...daemonclient.link import DaemonLink
from .blockfds import Holder
from .ciphers import Ciphers
from .decrypt import PARALLEL_MIN, ParallelDecrypt
from .memory import BlockMemory

log = logging.getLogger(__name__)

# No O_NOATIME: open(2) refuses it with EPERM unless the caller owns the file
# (or has CAP_FOWNER), so every hit of a reader that is not the daemon's uid
# became a miss. relatime already skips nearly every atime write.
# O_NONBLOCK: a FIFO planted in the cache tree must not block the open (it
# would hang the reading thread, a FUSE worker's too); it is refused by fstat.
# O_NOFOLLOW: a symlink at the block path is refused (ELOOP); a symlinked dir
# above it can lead only to a regular file of the daemon's uid (fstat), which
# must still authenticate. (RESOLVE_NO_SYMLINKS would refuse those too, but
# also a symlink in the configured cache dir path, and through ctypes it
# costs several microseconds more per hit than os.open.)
O_BLOCK_FILE = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW

# Cache-hit reads go through reusable buffers (the ciphertext, and the
# plaintext when the caller wants bytes): a few idle ones are kept in a list,
# taken and given back without a lock (list pop/append are atomic), so a hit
# costs no fresh allocation, zeroing or page faults (4 MiB for a block). One
# holds up to twice the largest block read whole, so at most _SCRATCH_KEPT
# such buffers (4 x ~8 MiB with 4 MiB blocks) stay per process and volume.
# The tier's reads decrypt into the same ones (`Scratch`, shared).
_SCRATCH_KEPT = 4           # idle buffers kept for reuse
_SCRATCH_MIN = 64 << 10


def check_block_stat(st: os.stat_result, owner: int | None, path: str) -> None:
    """FormatError unless `st` is a regular file of the daemon's uid `owner`."""
    if not stat.S_ISREG(st.st_mode) or (owner is not None and st.st_uid != owner):
        raise FormatError(f"{path} is not a regular file owned by the daemon's uid "
                          f"{owner} (mode {st.st_mode:o}, uid {st.st_uid})")


def deliver(data: bytes | memoryview, lo: int, hi: int, out: memoryview | None):
    """data[lo:hi] as bytes (a block received into a pooled buffer is a
    memoryview: `fetch`), or stored in `out` and its length returned."""
    if out is None:
        return data[lo:hi] if type(data) is bytes else data[lo:hi].tobytes()
    out[:hi - lo] = memoryview(data)[lo:hi]
    return hi - lo


class Scratch:
    """Idle read buffers (see _SCRATCH_KEPT): `take` one of at least `need`
    bytes, `give` it back when done."""

    __slots__ = ("_idle",)

    def __init__(self) -> None:
        self._idle: list[memoryview] = []

    def take(self, need: int) -> memoryview:
        try:
            buf = self._idle.pop()
        except IndexError:  # none idle
            buf = None
        if buf is None or len(buf) < need:
            buf = aligned(need if need > _SCRATCH_MIN else _SCRATCH_MIN)
        return buf

    def give(self, buf: memoryview) -> None:
        if len(self._idle) < _SCRATCH_KEPT:
            self._idle.append(buf)


class HitReader:
    """Reads blocks of one volume that this host already holds."""

    def __init__(self, name: str, chunk_size: int, mem: BlockMemory, link: DaemonLink,
                 counters: Counters, ciphers: Ciphers, decrypt: ParallelDecrypt):
        self.name = name
        self.chunk_size = chunk_size
        self.mem = mem
        self.link = link
        self.counters = counters
        self.ciphers = ciphers
        self.scratch = Scratch()  # shared with the tier's reads (see _SCRATCH_KEPT)
        self.nowait = nowait.SUPPORTED  # cleared if the kernel or cache fs refuses it
        self.chunks = None  # a `chunkhits.ChunkedHits`: small partial reads keep chunks
        self.decrypt = decrypt  # large reads' chunks on every core
        # keys just judged bad: the daemon indexes them until their eviction
        # (queued) is done, so their refill must not take "cached" for an answer
        self._bad: set[str] = set()

    def read(self, key: str, blen: int, lo: int, hi: int, out: memoryview | None,
             nowait: bool = False, holder: Holder | None = None, keep: bool = False):
        """Plaintext [lo, hi) of `key`'s block (`blen` bytes) from the memory
        LRU or the cache disk, counted as a hit (bytes, or the length stored
        in `out`); None for a miss. `nowait`: only what the kernel's caches
        hold, and a miss is neither counted nor judged. `holder`: the
        blocks of the open handle reading (its block files stay open);
        `keep`: the read keeps its chunks (`chunks.ChunkCache.wants` said so)."""
        chunks = self.chunks
        if keep:
            data, head = self.mem.get_bound(key)
            if data is not None:
                chunks.cache.saw(key, data, head, lo, hi)
                if holder is not None and head is not None and key not in holder.keys:
                    holder.hold_bound(key, head)
        else:
            data = self.mem.get(key)
        if data is not None:
            self.counters.add3("hits", "hit_bytes", hi - lo, "memory_hits")
            return deliver(data, lo, hi, out)
        layout = self.link.layout
        if layout is None:
            if not nowait:
                self.counters.add("daemon_unavailable")
            return None
        if nowait and not self.nowait:
            return None
        if keep:  # counts its hits itself
            return chunks.read(layout, key, blen, lo, hi, out, holder, nowait)
        got = self._read_file(layout.path(key), key, blen, lo, hi, out, nowait=nowait)
        if got is not None:
            self.counters.add2("hits", "hit_bytes", hi - lo)
            self.link.touch(key)
        return got

    def is_cached(self, key: str) -> bool:
        """True if `key`'s block file is there: a regular file of the daemon's
        uid, as `read` would use it (a link or a FIFO is not a block)."""
        layout = self.link.layout
        path = layout.path(key) if layout is not None else None
        if path is None:
            return False
        try:
            st = os.lstat(path)
        except OSError:
            return False
        owner = self.link.daemon_uid
        return stat.S_ISREG(st.st_mode) and (owner is None or st.st_uid == owner)

    def held(self, key: str) -> bool:
        """In memory or on the cache disk."""
        return self.mem.get(key) is not None or self.is_cached(key)

    def _read_file(self, path: str | None, key: str, blen: int, lo: int, hi: int,
                   out: memoryview | None = None, nowait: bool = False):
        """The range from the block file (bytes, or its length once stored in
        `out`), or None for a miss (bad files are evicted). `nowait`: only from
        the kernel's caches; None where that is not enough (short reads are
        then expected, so nothing is judged bad or evicted)."""
        if path is None:  # its cache dir is unhealthy
            return None
        try:
            fd = nowait_open(path, O_BLOCK_FILE) if nowait else os.open(path, O_BLOCK_FILE)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if isinstance(exc, Unsupported):
                self.nowait_refused(exc)
            elif exc.errno == errno.ELOOP and not nowait:  # a symlink in the cache tree
                self.bad_block(key, f"a symlink on its path {path}")
                return None
            log.debug("cannot open cached block %s: %s", path, exc)
            return None
        scratch = None
        try:
            st = os.fstat(fd)
            check_block_stat(st, self.link.daemon_uid, path)
            n = hi - lo
            if n >= PARALLEL_MIN and not nowait:  # read and decrypted unit by unit, on every core
                cipher = self.ciphers.cipher(key, os.pread(fd, HEADER_SIZE, 0), blen)
                if st.st_size != file_size(blen, self.chunk_size):
                    raise FormatError(f"block file is {st.st_size} bytes; its header says "
                                      f"{file_size(blen, self.chunk_size)}")
                self.counters.add("chunks_decrypted", (lo + n - 1) // self.chunk_size
                                  - lo // self.chunk_size + 1)
                if out is not None:  # `out` itself when it fits: a caller may release it
                    self.decrypt.read_file_into(cipher, fd, lo, out if len(out) == n else out[:n])
                    return n
                scratch = self.scratch.take(n)
                plain = scratch[:n]
                self.decrypt.read_file_into(cipher, fd, lo, plain)
                return plain.tobytes()
            # Where the chunks must be follows from the block length and this
            # volume's chunk size, so one pread usually gets header and chunks
            # together; the header read back must agree, and a read that
            # reaches the last chunk asks for one byte more to catch a file
            # that is longer or shorter than its header says.
            chunk = self.chunk_size
            if n == blen:  # the whole block (a small file's every read)
                first, end = 0, -(-blen // chunk) or 1
            else:
                first, end = chunk_span(blen, chunk, lo, n)
            start = HEADER_SIZE + first * (chunk + TAG_SIZE)
            if end * chunk >= blen:  # through the last chunk: to the end of the file, and one over
                stop = HEADER_SIZE + blen + end * TAG_SIZE
                want = stop - start + 1
            else:
                stop = HEADER_SIZE + end * (chunk + TAG_SIZE)
                want = stop - start
            # the ciphertext, then (when the caller wants bytes) the plaintext,
            # copied out once: decrypting chunk by chunk into new objects
            # would cost their zeroing and a join
            # (the ciphertext lands at its file offset's place in a page:
            # common/aligned; the plaintext after it)
            plain_at = PAGE + HEADER_SIZE + want
            need = plain_at + n if out is None else plain_at
            scratch = self.scratch.take(need)
            if first == 0:
                whole = scratch[:HEADER_SIZE + want]
                if nowait:
                    got = os.preadv(fd, [whole], 0, os.RWF_NOWAIT)
                    if got != HEADER_SIZE + stop - start:
                        return None  # pages not all in memory: the blocking read decides
                else:
                    got = os.preadv(fd, [whole], 0)
                head = scratch[:HEADER_SIZE if got > HEADER_SIZE else got]
                body = scratch[HEADER_SIZE:got if got > HEADER_SIZE else HEADER_SIZE]
            else:  # the header (after where the body lands), then the body
                k = start % PAGE
                at = plain_at - HEADER_SIZE
                flags = os.RWF_NOWAIT if nowait else 0
                got = os.preadv(fd, [scratch[at:plain_at]], 0, flags)
                head = scratch[at:at + got]
                got = os.preadv(fd, [scratch[k:k + want]], start, flags)
                if nowait and (len(head) != HEADER_SIZE or got != stop - start):
                    return None  # pages not all in memory: the blocking read decides
                body = scratch[k:k + got]
            cipher = self.ciphers.cipher(key, bytes(head), blen)
            if len(body) != stop - start:  # one byte over: longer; under: truncated
                raise FormatError(f"block file is shorter or longer than its header says "
                                  f"({len(body)} bytes where {stop - start} belong)")
            self.counters.add("chunks_decrypted", end - first)
            if out is None:
                plain = scratch[plain_at:plain_at + n]
                cipher.read_range_into(lo, body, plain)
                return plain.tobytes()
            cipher.read_range_into(lo, body, out[:n])
            return n
        except (FormatError, IntegrityError) as exc:
            if nowait:  # judged once, by the blocking read that follows
                return None
            self.bad_block(key, exc)
            return None
        except OSError as exc:  # a failing cache disk is a miss, never an error
            if nowait and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self.nowait_refused(exc)
            log.debug("cannot read cached block %s: %s", path, exc)
            return None
        finally:
            os.close(fd)
            if scratch is not None:
                self.scratch.give(scratch)

    def bad_block(self, key: str, why: object) -> None:
        """Count a cache file that is not an authentic block of ours, and have
        the daemon evict it (the refill replaces it)."""
        self.counters.add("integrity_failures")
        log.warning("cached block %s is bad (%s); evicting it and reading the backend", key, why)
        self.link.evict_later(key)
        if len(self._bad) >= 1024:
            self._bad.clear()
        self._bad.add(key)

    def judged_bad(self, key: str) -> bool:
        """Whether `key`'s cached block was just judged bad (asked once: its
        refill goes without a fetch lease, whose answer would be "cached")."""
        try:
            self._bad.remove(key)
        except KeyError:
            return False
        return True

    def nowait_refused(self, exc: OSError) -> None:
        if self.nowait:
            self.nowait = False
            log.info("volume %s: the cache dir cannot be read without blocking (%s); "
                     "hits are read on threads", self.name, exc)

