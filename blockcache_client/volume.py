"""The read-through reader: a remote volume seen through the host's block cache.

Read path for one block (key = vol_inode_extent_offset, see `keys`):

1. in-process memory LRU (`blockmem`): the block was fetched moments ago;
2. cache disk: with the layout from the daemon's `hello`, open the block
   file read-only, check its header and length, read and decrypt only the
   chunks the range touches; report the access later in a batched `touch`.
   No round trip to the daemon. The ciphertext goes to a reused buffer;
   `readinto` decrypts whole chunks straight into the caller's buffer (the
   FUSE client's path: one copy from the file, one to the kernel), `read`
   into the same reused buffer, copied out once into the bytes it returns.
   `readinto_nowait` does steps 1 and 2 only where the kernel answers from
   memory (`nowait`: openat2 RESOLVE_CACHED, preadv2 RWF_NOWAIT), so an event
   loop can serve a warm hit itself and never wait on a slow cache disk;
3. backend: fetch the whole block once (single-flight per key), keep it in
   the memory LRU, hand it to the fill queue (sealed and `put` in the
   background; a full queue drops and counts), return the requested bytes.

Coalesced fetches. A sequential read of a multi-block file (tracked per
file version: a read of 256 KiB or more at offset 0, or one starting within
512 KiB, at most an eighth of a block, of where the previous read ended,
the third such small read in a row or at once for 256 KiB and more) that
misses fetches a window of `_window` blocks (32 MiB, at most half the memory
LRU) with ONE ranged request: the missing block and the following ones
nobody has (not in memory, not on the cache disk, not being fetched). Those
are claimed in the single-flight table first, so a reader wanting one waits
for this request; the run stops at the first block someone has, so it stays
contiguous. Each block is split off and kept, sealed and put under its own
key, exactly as if fetched alone. Half way through a window the next one is
fetched in the background. A read spanning several blocks fetches its own
blocks with one request; any other read (random 4 KiB) fetches its block
only. `prefetch` coalesces the same way, one job per window.

Invariants:
- Never wrong bytes. Keys carry the file version, so a changed remote file
  gets new keys; every cached byte returned was authenticated under this
  volume's key and this exact key string; a backend answer of the wrong
  length for the version we hold, or (multi-block files, whose blocks are
  separate ranged reads) a version that changed by the end of a ranged
  read, raises ESTALE for every block of that read instead of any of them
  being served or cached (one If-Match, or one version check, covers the
  whole coalesced range).
- Bounded memory: a coalesced request is at most `_window` blocks, and
  `_window` is at most half the memory LRU, so a reader's current window and
  the one fetched ahead of it both fit; the fill queue stays bounded (full:
  drop and count).
- A read never fails because of the cache: a missing, corrupt, truncated or
  foreign block file, an unhealthy dir, or an unreachable daemon is a miss
  (counted); a bad block is evicted through the daemon and refilled.
- Only the daemon's files are read: a block file is opened without
  following a symlink (O_NOFOLLOW) and without blocking (O_NONBLOCK), and
  used only if it is a regular file owned by the daemon's uid (`hello`);
  anything else counts as a bad block. The daemon itself is believed only
  if SO_PEERCRED shows the expected uid (`client.check_peer`).
- Fork safe: every public call first checks the pid; a child (a DataLoader
  worker) builds fresh locks, caches, threads and connections and drops what
  it inherited, including queued fills.
- Picklable for spawn/forkserver workers: a pickle holds the constructor's
  arguments (the key file's path, never the key); unpickling builds a new
  Volume, which reads the key file again.

Known limit: a backend without ETags that rewrites a file in place with the
same size within one mtime tick looks unchanged (version = mtime_ns-size).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

from . import nowait
from .backend import Backend, FileInfo, normalize
from .blockmem import BlockMemory
from .common.forks import generation as _forks
from .contract import blockfile, protocol
from .contract.blockfile import HEADER_SIZE, TAG_SIZE, BlockCipher, chunk_span
from .contract.blockkey import KeyNamer, check_volume_name
from .contract.errors import (
    ConfigError,
    DaemonError,
    DaemonUnavailable,
    FormatError,
    IntegrityError,
)
from .counters import Counters
from .daemonlink import DaemonLink
from .nowait import Unsupported
from .nowait import open_cached as nowait_open
from .singleflight import SingleFlight
from .volumefile import VolumeFile
from .volumekey import load_key_file

log = logging.getLogger(__name__)

MAX_OFFSET = 2**63 - 1
_META_LIMIT = 1 << 20      # cached stat entries before the cache starts over
_IDENT_LIMIT = 1 << 18     # cached (path, version) -> key prefix entries
_CIPHER_LIMIT = 4096       # derived per-block ciphers kept (saves an HKDF per hit)
_PREFETCH_WORKERS = 4
_PREFETCH_PENDING = 256    # queued prefetch jobs before new ones are dropped
# Most bytes one sequential request asks the source for: each request to S3
# costs tens of ms whatever its size (and moto copies the whole object per
# ranged GET), so a sequential reader is served with few large requests.
_COALESCE_BYTES = 32 << 20
_SEQ_START = 256 << 10     # a read this large at offset 0 (or continuing one) is sequential
_SEQ_SLACK = 512 << 10     # "continues the previous read": starts this close to its end
                           # (and within an eighth of a block)
_STREAMS_LIMIT = 4096      # per-file sequential-read states kept before starting over
# No O_NOATIME: open(2) refuses it with EPERM unless the caller owns the file
# (or has CAP_FOWNER), so every hit of a reader that is not the daemon's uid
# became a miss. relatime already skips nearly every atime write.
# O_NONBLOCK: a FIFO planted in the cache tree must not block the open (on
# fsclient's event loop that would hang the mount); it is refused by fstat.
# O_NOFOLLOW: a symlink at the block path is refused (ELOOP); a symlinked dir
# above it can lead only to a regular file of the daemon's uid (fstat), which
# must still authenticate. (RESOLVE_NO_SYMLINKS would refuse those too, but
# also a symlink in the configured cache dir path, and through ctypes it
# costs several microseconds more per hit than os.open.)
_O_RDONLY = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW

# Cache-hit reads go through reusable buffers (the ciphertext, and the
# plaintext when the caller wants bytes): a few idle ones are kept in a list,
# taken and given back without a lock (list pop/append are atomic), so a hit
# costs no fresh allocation, zeroing or page faults (4 MiB for a block). One
# holds up to twice the largest block read whole, so at most _SCRATCH_KEPT
# such buffers (4 x ~8 MiB with 4 MiB blocks) stay per process and volume.
_SCRATCH_KEPT = 4           # idle buffers kept for reuse
_SCRATCH_MIN = 64 << 10


class _Stream:
    """The read pattern of one file version in this process: where the last
    read ended, how many reads in a row continued the one before, whether the
    current read is sequential, and the first block no request covers yet."""

    __slots__ = ("next_off", "streak", "streaming", "issued")

    def __init__(self) -> None:
        self.next_off = -1
        self.streak = 0
        self.streaming = False
        self.issued = 0


def _deliver(data: bytes, lo: int, hi: int, out: memoryview | None):
    """data[lo:hi] as bytes, or stored in `out` and its length returned."""
    if out is None:
        return data[lo:hi]
    out[:hi - lo] = memoryview(data)[lo:hi]
    return hi - lo


def _keep_cipher(ciphers: dict, lock: threading.Lock, ck: tuple[str, bytes],
                 cipher: BlockCipher) -> None:
    """Remember a block's cipher under (key, exact header bytes), the oldest
    entry going first past `_CIPHER_LIMIT`. Only writers lock: readers `get`."""
    with lock:
        ciphers[ck] = cipher
        if len(ciphers) > _CIPHER_LIMIT:
            del ciphers[next(iter(ciphers))]


class _Sealer:
    """The fill thread's `blockfile.seal`. It seals into one buffer it reuses
    (the link's put has sent the previous block before it asks for the next:
    a fresh 4 MiB object per block cost a page fault per 4 KiB), and keeps the
    new block's cipher, so this process reading the block back from the cache
    (the next epoch) skips its HKDF. Keyed by the exact header bytes it wrote:
    if the daemon keeps another writer's file instead, that header differs
    and this entry is simply never used. Holds no reference to the Volume
    (the link's threads would keep it alive)."""

    __slots__ = ("_volume_key", "_chunk_size", "_ciphers", "_lock", "_buf")

    def __init__(self, volume_key: bytes, chunk_size: int, ciphers: dict,
                 lock: threading.Lock) -> None:
        self._volume_key = volume_key
        self._chunk_size = chunk_size
        self._ciphers = ciphers
        self._lock = lock
        self._buf = bytearray()

    def __call__(self, key: str, plaintext: bytes) -> memoryview:
        """The block file's bytes: valid until the next call."""
        blob, cipher = blockfile.seal_into(key, plaintext, self._volume_key, self._chunk_size,
                                           self._buf)
        self._buf = blob.obj  # the larger one, if it had to grow
        _keep_cipher(self._ciphers, self._lock, (key, blob[:HEADER_SIZE].tobytes()), cipher)
        return blob


def _rebuild_volume(args: tuple, storage_options: dict) -> "Volume":
    """Unpickle a `Volume`: construct it again in this process."""
    return Volume(*args, **storage_options)


class Volume:
    """A named remote volume read through the host's shared, encrypted block cache.

    `source` is an fsspec URL (local path, `file://`, `s3://bucket/prefix`,
    chained URLs); `storage_options` go to fsspec (or `fs=` an fsspec filesystem
    already built, `source` then being the root path in it). `socket_path` defaults to
    $BLOCKCACHE_SOCKET or /run/blockcache/blockcached.sock; without a daemon
    every read goes to the backend. `daemon_uid`: the uid the daemon must
    answer as, besides root (default $BLOCKCACHE_DAEMON_UID, else the owner
    of the socket's dir; see `client`). All methods are thread-safe.
    """

    def __init__(self, name: str, source: str, key_file: str, socket_path: str | None = None,
                 block_size: int = 4 << 20, meta_ttl: float = 60.0,
                 fill_queue_bytes: int = 256 << 20, memory_cache_bytes: int = 64 << 20,
                 daemon_uid: int | None = None, **storage_options):
        self.name = check_volume_name(name)
        # what a pickle carries to rebuild this volume in another process: the
        # key file's path, never the key
        self._init_args = (name, source, key_file, socket_path, block_size, meta_ttl,
                           fill_queue_bytes, memory_cache_bytes, daemon_uid)
        self._storage_options = dict(storage_options)
        if (not isinstance(block_size, int) or isinstance(block_size, bool)
                or not blockfile.MIN_CHUNK <= block_size <= blockfile.MAX_PLAINTEXT):
            raise ConfigError(f"volume {name}: block size {block_size!r} must be an integer "
                              f"in {blockfile.MIN_CHUNK}..{blockfile.MAX_PLAINTEXT}")
        self.block_size = block_size
        self.meta_ttl = float(meta_ttl)
        self._volume_key = load_key_file(key_file)
        self._key_id = blockfile.key_id(self._volume_key)
        # block names derive from the key too: equal on every host with it,
        # opaque to others, and a same-named volume under another key is
        # another namespace (its blocks are misses here, not failures)
        self.names = KeyNamer(self._volume_key)
        self._chunk_size = min(blockfile.DEFAULT_CHUNK, 1 << (block_size.bit_length() - 1))
        self.socket_path = socket_path or protocol.default_socket()
        self._daemon_uid = daemon_uid
        self._fill_queue_bytes = fill_queue_bytes
        self._memory_cache_bytes = memory_cache_bytes
        # blocks one sequential request may bring: two windows (the one being
        # read, the one fetched ahead) fit in the memory LRU; 1 = no coalescing
        self._window = max(1, min(_COALESCE_BYTES // block_size,
                                  max(0, memory_cache_bytes) // (2 * block_size)))
        self._seq_slack = min(_SEQ_SLACK, block_size // 8)
        self.backend = Backend(source, **storage_options)
        root = self.backend.stat("")  # an unreadable source fails here, by name
        if not root.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, f"volume {name}: source {source} is not "
                                                    f"a directory")
        self._closed = False
        self._pid = -1
        self._start_process()

    # -- per-process state (rebuilt after fork) ----------------------------------

    def _start_process(self) -> None:
        self._pid = os.getpid()
        self._fork_gen = _forks[0]
        self._meta: dict[str, tuple[float, FileInfo]] = {}
        # paths the backend said do not exist (Python's import probes many)
        self._missing: dict[str, tuple[float, str]] = {}
        # (when, entries, their names) of each listed directory
        self._dirs: dict[str, tuple[float, list[FileInfo], frozenset[str]]] = {}
        # backend stats per directory since its last listing, None = not listable
        self._dir_misses: dict[str, int | None] = {}
        self._idents: dict[tuple[str, str], str] = {}
        self._streams: dict[str, _Stream] = {}  # by key prefix (file version)
        self._ciphers: dict[tuple[str, bytes], BlockCipher] = {}
        self._cipher_lock = threading.Lock()
        self._mem = BlockMemory(self._memory_cache_bytes)
        self._scratch: list[memoryview] = []  # idle hit buffers (see _SCRATCH_KEPT)
        self._flight = SingleFlight()
        self.counters = Counters()
        # the sealer must not reference self, or the link's threads would keep us alive
        seal = _Sealer(self._volume_key, self._chunk_size, self._ciphers, self._cipher_lock)
        self._link = DaemonLink(self.socket_path, self.counters, seal,
                                self._fill_queue_bytes, client_name=f"volume:{self.name}",
                                daemon_uid=self._daemon_uid)
        # a Volume dropped without close() must not leave its threads reconnecting forever
        weakref.finalize(self, self._link.close, 0.2)
        self._prefetch_pool: ThreadPoolExecutor | None = None
        self._nowait = nowait.SUPPORTED  # cleared if the kernel or cache fs refuses it
        self._prefetch_pending = 0
        self._prefetch_lock = threading.Lock()

    def _proc(self) -> None:
        if self._fork_gen != _forks[0]:
            log.debug("volume %s: new process %d, rebuilding per-process state",
                      self.name, os.getpid())
            self._start_process()
        elif self._closed:
            raise ValueError(f"volume {self.name} is closed")

    def close(self) -> None:
        """Flush pending fills briefly, stop background threads."""
        if self._closed:
            return
        self._closed = True
        if self._pid == os.getpid():
            if self._prefetch_pool is not None:
                self._prefetch_pool.shutdown(wait=False, cancel_futures=True)
            self._link.close()
            self.backend.close()

    def __enter__(self) -> "Volume":
        return self

    def __reduce__(self):
        # A spawn/forkserver worker (a DataLoader's) gets a new Volume built
        # from the same arguments: the key is read again from its file there.
        if self._closed:
            raise ValueError(f"volume {self.name} is closed: a closed volume cannot be pickled")
        return (_rebuild_volume, (self._init_args, self._storage_options))

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- metadata ----------------------------------------------------------------

    def _fresh(self, cache: dict, rel: str, max_age: float | None):
        """(the cached value if young enough else None, now)."""
        ttl = self.meta_ttl if max_age is None else max_age
        hit = cache.get(rel)
        now = time.monotonic()
        if hit is not None and ttl > 0 and now - hit[0] <= ttl:
            return hit[1], now
        return None, now

    def stat(self, path: str, max_age: float | None = None) -> FileInfo:
        """Info of `path`, cached up to `meta_ttl` seconds (or `max_age`; 0 = fresh)."""
        self._proc()
        return self._stat_rel(normalize(path), max_age)

    def _stat_rel(self, rel: str, max_age: float | None = None) -> FileInfo:
        """`stat` of an already normalized path. A missing path is remembered
        as missing for as long as a found one would be; a fresh listing of its
        parent that does not name it answers too, without a backend call."""
        hit, now = self._fresh(self._meta, rel, max_age)
        if hit is not None:
            return hit
        why, _ = self._fresh(self._missing, rel, max_age)
        if why is None and rel:
            parent, _, name = rel.rpartition("/")
            listing = self._dirs.get(parent)
            if (listing is not None and self._fresh(self._dirs, parent, max_age)[0] is not None
                    and name not in listing[2]):
                why = f"stat {rel} in {self.backend.source}: not in the listing of its directory"
            elif parent:
                why, _ = self._fresh(self._missing, parent, max_age)  # under a missing dir
        if why is not None:
            raise FileNotFoundError(errno.ENOENT, why)
        if rel and max_age != 0 and self._second_miss_in(rel.rpartition("/")[0]):
            found = self._stat_by_listing(rel, now)
            if found is not None:
                return found
        try:
            info = self.backend.stat(rel)
        except FileNotFoundError as exc:
            self._remember_missing(rel, now, exc.strerror or str(exc))
            raise
        self._remember(rel, info, now)
        return info

    def _second_miss_in(self, parent: str) -> bool:
        """Count a backend stat in `parent`; True from the second one on while
        no fresh listing of it is held. One stat in a directory costs one
        request; a job that stats many (an epoch's first pass, a dataset
        index) gets the whole directory from one listing instead of a
        request per file, like fsclient's lookups."""
        n = self._dir_misses.get(parent, 0)
        if n is None:
            return False  # it could not be listed: stat its paths one by one
        if len(self._dir_misses) >= _META_LIMIT // 64:
            self._dir_misses.clear()
        self._dir_misses[parent] = n + 1
        return n + 1 >= 2

    def _stat_by_listing(self, rel: str, now: float) -> FileInfo | None:
        """Answer a stat from a fresh listing of its parent: the entry, or
        FileNotFoundError when the listing does not name it or the parent does
        not exist (both remembered as missing); None when the parent cannot be
        listed otherwise (not a directory, a backend that does not list), for
        the caller to stat the path itself, as it then will for every path
        in that parent."""
        parent = rel.rpartition("/")[0]
        try:
            self._list_rel(parent)
        except FileNotFoundError:
            why = f"stat {rel} in {self.backend.source}: its directory {parent} does not exist"
            self._remember_missing(parent, now, why)
        except (OSError, ValueError) as exc:
            log.debug("listing %r to answer a stat failed (%s); stat instead", parent, exc)
            self._dir_misses[parent] = None
            return None
        else:
            hit = self._meta.get(rel)
            if hit is not None:
                return hit[1]
            why = f"stat {rel} in {self.backend.source}: not in the listing of its directory"
        self._remember_missing(rel, now, why)
        raise FileNotFoundError(errno.ENOENT, why)

    def _remember_missing(self, rel: str, now: float, why: str) -> None:
        if len(self._missing) >= _META_LIMIT:
            self._missing.clear()  # bounded like the positive cache
        self._missing[rel] = (now, why)

    def _remember(self, rel: str, info: FileInfo, now: float) -> None:
        if len(self._meta) >= _META_LIMIT:
            self._meta.clear()  # crude but bounded; entries refill on demand
        self._meta[rel] = (now, info)
        self._missing.pop(rel, None)

    def listdir(self, path: str, max_age: float | None = None) -> list[FileInfo]:
        """Entries of a directory (sorted by name); also fills the stat cache."""
        self._proc()
        return list(self._list_rel(normalize(path), max_age))

    def _list_rel(self, rel: str, max_age: float | None = None) -> list[FileInfo]:
        """`listdir` of an already normalized path (the cached list itself)."""
        hit, now = self._fresh(self._dirs, rel, max_age)
        if hit is not None:
            return hit
        infos = self.backend.listdir(rel)
        if len(self._dirs) >= _META_LIMIT // 64:
            self._dirs.clear()
        self._dirs[rel] = (now, infos, frozenset(info.name for info in infos))
        for info in infos:  # canonical paths only: the backend leaves out the rest
            self._remember(info.path, info, now)
        self._dir_misses.pop(rel, None)
        return infos

    def readlink(self, path: str) -> str:
        """Target of a symbolic link in the volume."""
        self._proc()
        return self.backend.readlink(normalize(path))

    def inode(self, path: str) -> int:
        """The stable inode of `path` (the same on every host with the key):
        `KeyNamer.inode`."""
        return self.names.inode(normalize(path))

    # -- keys --------------------------------------------------------------------

    def _key_prefix(self, rel: str, version: str) -> str:
        """`vol_inode_extent_` for one version of a file (validated once, then cached)."""
        ident = (rel, version)
        prefix = self._idents.get(ident)
        if prefix is None:
            # BlockKey's canonical form, written out: every part is valid by
            # construction (the name was checked at __init__, the inode and
            # extent are 63/64-bit hashes), and a new process computes this for
            # every file it opens, so the dataclass's checks (~3 us) are skipped
            # (tests/blockcache_client compares it with str(BlockKey(...))).
            prefix = self.names.file_prefix(self.name, rel, version, self.block_size)
            if len(self._idents) >= _IDENT_LIMIT:
                self._idents.clear()
            self._idents[ident] = prefix
        return prefix

    # -- reads -------------------------------------------------------------------

    def _resolve(self, path: str, info: FileInfo | None) -> tuple[str, FileInfo]:
        rel = normalize(path)
        if info is None:
            self._proc()
            info = self._stat_rel(rel)
        elif not isinstance(info, FileInfo) or info.path != rel:
            raise OSError(errno.EINVAL, f"read {path}: the pinned FileInfo is for "
                                        f"{getattr(info, 'path', info)!r}, not this path")
        if info.is_dir:
            raise IsADirectoryError(errno.EISDIR, f"read {path}: is a directory in volume "
                                                  f"{self.name}")
        return rel, info

    @staticmethod
    def _check_range(path: str, offset: int, size: int) -> None:
        for what, v in (("offset", offset), ("size", size)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"read {path}: {what} must be an int, not {type(v).__name__}")
            if not 0 <= v <= MAX_OFFSET:
                raise OSError(errno.EINVAL, f"read {path}: {what} {v} is outside 0..2**63-1")

    def read(self, path: str, offset: int, size: int, info: FileInfo | None = None) -> bytes:
        """Up to `size` bytes at `offset` (fewer only at end of file).

        `info` pins the version (FUSE passes what it got at open); without it
        the cached metadata is used.
        """
        self._proc()
        self._check_range(path, offset, size)
        rel, info = self._resolve(path, info)
        return self._read_pinned(rel, offset, size, info)

    def _read_pinned(self, rel: str, offset: int, size: int, info: FileInfo,
                     out: memoryview | None = None):
        """`read` after its checks: `rel` normalized, `info` its pinned version,
        offset and size valid (VolumeFile calls this directly). With `out` (a
        writable byte view of `size` bytes) the bytes are stored there and
        their count returned, with no intermediate copy."""
        if self._fork_gen != _forks[0] or self._closed:
            self._proc()
        end = min(offset + size, info.size)
        if offset >= end:
            return b"" if out is None else 0
        bs = self.block_size
        first = offset // bs
        last = (end - 1) // bs
        prefix = self._key_prefix(rel, info.version)
        st = None
        if self._window > 1 and info.size > bs:
            st = self._follow(prefix, offset, end, last > first)
        if first == last and st is None:
            boff = first * bs
            return self._read_block(rel, info, prefix, boff, offset - boff, end - boff, out)
        parts = []
        pos = 0
        for b in range(first, last + 1):
            boff = b * bs
            run = 1 if st is None else self._plan(st, rel, info, prefix, b, last)
            lo, hi = max(offset, boff) - boff, min(end, boff + bs) - boff
            if out is None:
                parts.append(self._read_block(rel, info, prefix, boff, lo, hi, None, run))
            else:
                self._read_block(rel, info, prefix, boff, lo, hi, out[pos:pos + hi - lo], run)
            pos += hi - lo
        return b"".join(parts) if out is None else pos

    def _follow(self, prefix: str, offset: int, end: int, multi: bool) -> _Stream | None:
        """Track the read pattern of one file version; its `_Stream` if this
        read may fetch more than the block it misses (a sequential read, or
        one spanning several blocks), else None. Racing threads on one file
        can only make the guess worse, never a read wrong."""
        st = self._streams.get(prefix)
        if st is None:
            if len(self._streams) >= _STREAMS_LIMIT:
                self._streams.clear()
            st = self._streams[prefix] = _Stream()
        big = end - offset >= _SEQ_START
        if st.next_off >= 0 and abs(offset - st.next_off) <= self._seq_slack:
            st.streak += 1
            # a random small read may land next to the last one by chance:
            # only a third one in a row (or a large one) makes it a stream
            st.streaming = st.streak >= 2 or big
        else:
            st.streak = 0
            st.streaming = offset == 0 and big
            st.issued = offset // self.block_size  # a new run: nothing fetched for it yet
        st.next_off = end
        return st if st.streaming or multi else None

    def _plan(self, st: _Stream, rel: str, info: FileInfo, prefix: str, b: int,
              last: int) -> int:
        """How many blocks from block `b` one request may fetch if `b` is a
        miss. A sequential reader gets a window, and the next window is
        fetched in the background once half of this one is read; a
        non-sequential multi-block read gets just its own blocks."""
        win = self._window
        if not st.streaming:
            return min(win, last + 1 - b)
        bs = self.block_size
        nblocks = -(-info.size // bs)
        if b >= st.issued:
            st.issued = min(nblocks, b + win)
            key = prefix + format(b * bs, "016x")
            if self._mem.get(key) is None and not self._is_cached(key):
                return st.issued - b  # the miss brings the window
            if st.issued > b + 1:  # a hit: the rest of the window in the background
                self._submit(self._prefetch_run, rel, info, prefix, (b + 1) * bs,
                             min(info.size, st.issued * bs))
            return 1
        if st.issued < nblocks and st.issued - b <= win // 2:
            start = st.issued
            st.issued = min(nblocks, start + win)
            self._submit(self._prefetch_run, rel, info, prefix, start * bs,
                         min(info.size, st.issued * bs))
        # a miss here (the background job is still queued, or the block was
        # evicted) brings the rest of its window; blocks that job already
        # claimed stop the run, so nothing is fetched twice
        return min(win, st.issued - b)

    def readinto(self, path: str, offset: int, buffer, info: FileInfo | None = None) -> int:
        """Read into a writable buffer; returns the number of bytes stored
        (fewer than its length only at end of file). Cached blocks decrypt
        straight into the buffer. If it raises, the buffer's contents are
        undefined (but never unauthenticated cache bytes)."""
        view = memoryview(buffer).cast("B")
        self._proc()
        self._check_range(path, offset, len(view))
        rel, info = self._resolve(path, info)
        return self._read_pinned(rel, offset, len(view), info, view)

    def readinto_nowait(self, path: str, offset: int, buffer, info: FileInfo) -> int | None:
        """`readinto` of a range within one block, only if it needs no wait:
        the block is in the memory LRU, or its cache file's path and bytes are
        in the kernel's caches. None otherwise (a miss, pages not in memory, a
        bad or short file, a second block, no kernel support): nothing is then
        counted or evicted, and `readinto` on a thread does the real read and
        decides. Never touches the backend, never blocks on a disk: an event
        loop may call it."""
        view = memoryview(buffer).cast("B")
        self._proc()
        self._check_range(path, offset, len(view))
        rel, info = self._resolve(path, info)
        end = min(offset + len(view), info.size)
        if offset >= end:
            return 0
        bs = self.block_size
        boff = offset - offset % bs
        if end > boff + bs:
            return None
        key = self._key_prefix(rel, info.version) + format(boff, "016x")
        return self._read_hit(key, self._block_len(info, boff), offset - boff, end - boff, view,
                              nowait=True)

    def open(self, path: str):
        """A read-only binary file object (read, readinto, seek, tell) pinned
        to the version of `path` seen now."""
        # A path the metadata cache holds fresh is canonical (only normalized
        # paths are remembered: `_stat_rel` and `_list_rel`), so a dataset
        # opening the paths it listed skips `normalize` and `_resolve`.
        if type(path) is str and self._fork_gen == _forks[0] and not self._closed:
            info, _ = self._fresh(self._meta, path, None)
            if info is not None and not info.is_dir:
                return VolumeFile(self, path, info)
        rel, info = self._resolve(path, None)  # checks the process too
        return VolumeFile(self, rel, info)

    def _block_len(self, info: FileInfo, boff: int) -> int:
        return min(self.block_size, info.size - boff)

    def _read_block(self, rel: str, info: FileInfo, prefix: str, boff: int,
                    lo: int, hi: int, out: memoryview | None = None, run: int = 1):
        """Plaintext [lo, hi) of the block at `boff`: as bytes, or stored in
        `out` (hi - lo bytes long) and its length returned. A miss may fetch
        up to `run` blocks from `boff` in one request."""
        key = prefix + format(boff, "016x")
        blen = info.size - boff  # `_block_len`, inline: the hit path's every call counts
        got = self._read_hit(key, blen if blen < self.block_size else self.block_size, lo, hi,
                             out)
        if got is not None:
            return got
        data = self._fetch(rel, info, key, boff, run)
        self.counters.add2("misses", "miss_bytes", hi - lo)
        return _deliver(data, lo, hi, out)

    def _read_hit(self, key: str, blen: int, lo: int, hi: int, out: memoryview | None,
                  nowait: bool = False):
        """Plaintext [lo, hi) of `key`'s block (`blen` bytes) from the memory
        LRU or the cache disk, counted as a hit (bytes, or the length stored
        in `out`); None for a miss. `nowait`: only what the kernel's caches
        hold (see `readinto_nowait`), and a miss is neither counted nor judged."""
        data = self._mem.get(key)
        if data is not None:
            self.counters.add3("hits", "hit_bytes", hi - lo, "memory_hits")
            return _deliver(data, lo, hi, out)
        layout = self._link.layout
        if layout is None:
            if not nowait:
                self.counters.add("daemon_unavailable")
            return None
        if nowait and not self._nowait:
            return None
        got = self._read_cached(layout.path(key), key, blen, lo, hi, out, nowait=nowait)
        if got is not None:
            self.counters.add2("hits", "hit_bytes", hi - lo)
            self._link.touch(key)
        return got

    def _read_cached(self, path: str | None, key: str, blen: int, lo: int, hi: int,
                     out: memoryview | None = None, nowait: bool = False):
        """The range from the block file (bytes, or its length once stored in
        `out`), or None for a miss (bad files are evicted). `nowait`: only from
        the kernel's caches; None where that is not enough (short reads are
        then expected, so nothing is judged bad or evicted)."""
        if path is None:  # its cache dir is unhealthy
            return None
        try:
            fd = nowait_open(path, _O_RDONLY) if nowait else os.open(path, _O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if isinstance(exc, Unsupported):
                self._nowait_refused(exc)
            elif exc.errno == errno.ELOOP and not nowait:  # a symlink in the cache tree
                self._bad_block(key, f"a symlink on its path {path}")
                return None
            log.debug("cannot open cached block %s: %s", path, exc)
            return None
        scratch = None
        try:
            st = os.fstat(fd)
            owner = self._link.daemon_uid
            if not stat.S_ISREG(st.st_mode) or (owner is not None and st.st_uid != owner):
                raise FormatError(f"{path} is not a regular file owned by the daemon's uid "
                                  f"{owner} (mode {st.st_mode:o}, uid {st.st_uid})")
            # Where the chunks must be follows from the block length and this
            # volume's chunk size, so one pread usually gets header and chunks
            # together; the header read back must agree, and a read that
            # reaches the last chunk asks for one byte more to catch a file
            # that is longer or shorter than its header says.
            chunk = self._chunk_size
            n = hi - lo
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
            plain_at = HEADER_SIZE + want
            need = plain_at + n if out is None else plain_at
            try:
                scratch = self._scratch.pop()
            except IndexError:  # none idle
                pass
            if scratch is None or len(scratch) < need:
                scratch = memoryview(bytearray(need if need > _SCRATCH_MIN else _SCRATCH_MIN))
            if first == 0:
                whole = scratch[:plain_at]
                if nowait:
                    got = os.preadv(fd, [whole], 0, os.RWF_NOWAIT)
                    if got != HEADER_SIZE + stop - start:
                        return None  # pages not all in memory: the blocking read decides
                else:
                    got = os.preadv(fd, [whole], 0)
                head = scratch[:HEADER_SIZE if got > HEADER_SIZE else got]
                body = scratch[HEADER_SIZE:got if got > HEADER_SIZE else HEADER_SIZE]
            elif nowait:
                return None
            else:
                head = os.pread(fd, HEADER_SIZE, 0)
                body = scratch[:os.preadv(fd, [scratch[:want]], start)]
            head = bytes(head)
            ck = (key, head)
            cipher = self._ciphers.get(ck)  # a dict get is atomic: no lock on the hit path
            if cipher is None:
                # a header seen before was validated then, and its HKDF subkey
                # is derived once: FormatError for a bad header, IntegrityError
                # for a foreign key
                cipher = BlockCipher.from_head(head, key, self._volume_key, self._key_id)
                _keep_cipher(self._ciphers, self._cipher_lock, ck, cipher)
            if cipher.plaintext_len != blen or cipher.chunk_size != chunk:
                raise FormatError(f"block holds {cipher.plaintext_len} bytes in chunks of "
                                  f"{cipher.chunk_size}; this file version needs {blen} in "
                                  f"chunks of {chunk}")
            if len(body) != stop - start:  # one byte over: longer; under: truncated
                raise FormatError(f"block file is shorter or longer than its header says "
                                  f"({len(body)} bytes where {stop - start} belong)")
            if out is None:
                plain = scratch[plain_at:plain_at + n]
                cipher.read_range_into(lo, body, plain)
                return plain.tobytes()
            cipher.read_range_into(lo, body, out[:n])
            return n
        except (FormatError, IntegrityError) as exc:
            if nowait:  # judged once, by the blocking read that follows
                return None
            self._bad_block(key, exc)
            return None
        except OSError as exc:  # a failing cache disk is a miss, never an error
            if nowait and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait_refused(exc)
            log.debug("cannot read cached block %s: %s", path, exc)
            return None
        finally:
            os.close(fd)
            if scratch is not None and len(self._scratch) < _SCRATCH_KEPT:
                self._scratch.append(scratch)

    def _bad_block(self, key: str, why: object) -> None:
        """Count a cache file that is not an authentic block of ours, and have
        the daemon evict it (the refill replaces it)."""
        self.counters.add("integrity_failures")
        log.warning("cached block %s is bad (%s); evicting it and reading the backend", key, why)
        self._link.evict_later(key)

    def _nowait_refused(self, exc: OSError) -> None:
        if self._nowait:
            self._nowait = False
            log.info("volume %s: the cache dir cannot be read without blocking (%s); "
                     "hits are read on threads", self.name, exc)

    def _fetch(self, rel: str, info: FileInfo, key: str, boff: int, run: int = 1) -> bytes:
        """The whole block from the backend, once per key however many ask;
        the same request may bring up to `run` - 1 following blocks."""
        data, _ = self._flight.do(key, lambda: self._load(rel, info, key, boff, run))
        return data

    def _load(self, rel: str, info: FileInfo, key: str, boff: int, run: int) -> bytes:
        """`_fetch`'s leader: claim the following blocks nobody has (up to
        `run` in all, stopping at the first one in memory, on the cache disk or
        being fetched: the range stays contiguous), read them all with one
        request, then keep each block and hand it to its waiters. A failure
        (ESTALE included) is every claimed block's: none is kept."""
        data = self._mem.get(key)
        if data is not None:  # a leader just before us finished between our checks
            return data
        bs = self.block_size
        prefix = key[:-16]
        claims = []
        stop = boff + bs
        while len(claims) + 1 < run and stop < info.size:
            k = prefix + format(stop, "016x")
            if self._mem.get(k) is not None or self._is_cached(k):
                break
            call = self._flight.claim(k)
            if call is None:
                break
            landed = self._mem.get(k)
            if landed is not None:  # landed between the check and the claim
                self._flight.settle(k, call, landed)
                break
            claims.append((k, call))
            stop += bs
        try:
            blocks = self._read_source(rel, info, boff, min(stop, info.size))
        except BaseException as exc:
            for k, call in claims:
                self._flight.settle(k, call, error=exc)
            raise
        self._keep(key, blocks[0])
        for (k, call), block in zip(claims, blocks[1:]):
            self._keep(k, block)
            self._flight.settle(k, call, block)
        if claims:
            self.counters.add("prefetches", len(claims))
        return blocks[0]

    def _keep(self, key: str, data: bytes) -> None:
        self._mem.put(key, data)
        if self._link.connected:
            self._link.offer_fill(key, data)

    def _read_source(self, rel: str, info: FileInfo, start: int, stop: int) -> list[bytes]:
        """Bytes [start, stop) of `info`'s version, with one request, split
        into blocks; ESTALE if the source no longer holds exactly that."""
        want = stop - start
        backend = self.backend
        bs = self.block_size
        if info.size <= bs:  # one read of one version
            data = [backend.read(rel, start, stop)]
        else:
            # The blocks of a multi-block file come from separate ranged
            # reads: each must be of `info`'s version, or one key could
            # name a block of another version and a pinned reader could
            # mix versions. S3 and local files prove it within the read;
            # other backends stat after it (counted as a version check).
            try:
                data = backend.read_version(rel, start, stop, info.version, piece=bs)
            except OSError as exc:
                if exc.errno != errno.ESTALE:
                    raise
                data = None
            if not backend.native_versioned_reads:
                self.counters.add2("backend_requests", "version_checks", 1)
        got = -1 if data is None else sum(map(len, data))
        self.counters.add2("backend_requests", "backend_bytes", max(got, 0))
        if got != want:
            self._meta.pop(rel, None)
            raise OSError(errno.ESTALE, f"read {rel} in volume {self.name}: the file "
                                        f"changed while being read (version {info.version}, "
                                        f"{want} bytes wanted at offset {start}"
                                        f"{'' if data is None else f', {got} read'}); "
                                        f"stat it again and retry")
        return data

    # -- cache control -----------------------------------------------------------

    def _blocks(self, path: str, info: FileInfo | None, offset: int = 0,
                length: int | None = None):
        rel, info = self._resolve(path, info)
        prefix = self._key_prefix(rel, info.version)
        end = info.size if length is None else min(info.size, offset + length)
        bs = self.block_size
        for b in range(offset // bs, -(-end // bs)):
            yield rel, info, prefix + format(b * bs, "016x"), b * bs

    def prefetch(self, path: str, offset: int, length: int, info: FileInfo | None = None) -> None:
        """Fetch the blocks of [offset, offset+length) into the cache in the
        background (readahead): consecutive missing blocks in one request of
        up to `_window` blocks, one job per window so windows arrive in
        parallel. Never blocks on the backend, never raises for I/O."""
        self._proc()
        self._check_range(path, offset, length)
        rel = normalize(path)
        if info is None:  # stat-ing could block: do it in the background too
            self._submit(self._prefetch_range, rel, offset, length, None)
        else:
            self._prefetch_range(rel, offset, length, info)

    def _prefetch_range(self, rel: str, offset: int, length: int, info: FileInfo | None) -> None:
        try:
            rel, info = self._resolve(rel, info)
            prefix = self._key_prefix(rel, info.version)
            bs = self.block_size
            end = min(info.size, offset + length)
            step = self._window * bs
            boff = offset - offset % bs
            while boff < end:
                if not self._submit(self._prefetch_run, rel, info, prefix, boff,
                                    min(end, boff + step)):
                    return
                boff += step
        except Exception as exc:  # readahead is best effort; the real read reports errors
            log.debug("prefetch %s failed: %s", rel, exc)

    def _prefetch_run(self, rel: str, info: FileInfo, prefix: str, start: int, end: int) -> None:
        """Fetch the blocks of [start, end) (block-aligned `start`) that are
        neither in memory, cached nor being fetched: each run of consecutive
        missing ones with one request."""
        bs = self.block_size
        boff = start
        try:
            while boff < end:
                key = prefix + format(boff, "016x")
                if (self._mem.get(key) is None and not self._flight.busy(key)
                        and not self._is_cached(key)):
                    self._fetch(rel, info, key, boff, -(-(end - boff) // bs))
                    self.counters.add("prefetches")
                boff += bs
        except Exception as exc:
            log.debug("prefetch of %s at %d failed: %s", rel, boff, exc)

    def _submit(self, fn, *args) -> bool:
        """Run fn(*args) on the prefetch pool unless too much is queued already."""
        with self._prefetch_lock:
            if self._prefetch_pending >= _PREFETCH_PENDING:
                self.counters.add("prefetches_dropped")
                return False
            self._prefetch_pending += 1
            if self._prefetch_pool is None:
                self._prefetch_pool = ThreadPoolExecutor(_PREFETCH_WORKERS,
                                                         thread_name_prefix="blockcache-prefetch")
            pool = self._prefetch_pool

        def run() -> None:
            try:
                fn(*args)
            finally:
                with self._prefetch_lock:
                    self._prefetch_pending -= 1
        try:
            pool.submit(run)
        except RuntimeError:  # the volume is closing
            with self._prefetch_lock:
                self._prefetch_pending -= 1
            return False
        return True

    def _is_cached(self, key: str) -> bool:
        layout = self._link.layout
        path = layout.path(key) if layout is not None else None
        return path is not None and os.path.exists(path)

    def cached_bytes(self, path: str, info: FileInfo | None = None) -> int:
        """Plaintext bytes of this file (this version) in the host cache now."""
        self._proc()
        total = 0
        for _, info, key, boff in self._blocks(path, info):
            if self._is_cached(key):
                total += self._block_len(info, boff)
        return total

    def block_map(self, path: str, info: FileInfo | None = None) -> list[tuple[int, int, bool]]:
        """(offset, length, cached now) of each block of this file version, in
        order; "cached" checks the block file through the layout (no daemon
        round trip, no read). Warmup uses it to fetch only what is missing."""
        self._proc()
        return [(boff, self._block_len(info, boff), self._is_cached(key))
                for _, info, key, boff in self._blocks(path, info)]

    def evict(self, path: str, info: FileInfo | None = None) -> int:
        """Remove this file's blocks (every version) from the cache; returns how
        many the daemon removed (0 if it is unreachable)."""
        self._proc()
        rel = normalize(path)
        ino = self.names.inode(rel)
        self._mem.discard_prefix(f"{self.name}_{ino}_")
        try:
            return self._link.evict_inode(self.name, ino)
        except (DaemonUnavailable, DaemonError) as exc:
            self.counters.add("daemon_unavailable")
            log.info("evict %s: %s", rel, exc)
            return 0

    def wait_fills(self, timeout: float = 10.0) -> bool:
        """Block until queued fills have been handed to the daemon (tests, warmup)."""
        self._proc()
        return self._link.wait_idle(timeout)

    def stats(self) -> dict:
        """Counters of this process's reads (see `counters.VOLUME_COUNTERS`) plus
        the link state."""
        self._proc()
        out: dict = self.counters.snapshot()
        out["daemon_connected"] = self._link.connected
        out["layout_epoch"] = self._link.layout_epoch
        out["fill_queue_bytes"] = self._link.pending_fill_bytes()
        out["memory_bytes"] = self._mem.used
        return out
