"""The read-through reader: a remote volume seen through the host's block cache.

`Volume` is the facade: the public API, the per-process state and fork
handling, block keys, and the walk of one read down the parts in this
package (see `__init__`):

1. `hits`: the memory LRU (`memory`: blocks fetched moments ago, and
   decrypted chunks of small reads, `chunks`), then the cache disk, read and
   decrypted by the reader itself with the layout from the daemon's `hello`
   (no round trip; accesses are reported in batched `touch`es);
2. `tier`: the cluster tier, if the daemon names one (slices of a block for
   a random read inside it; else whole blocks, handed sealed to the daemon);
3. `fetch`: else the whole block from the source, once however many threads
   ask, kept in the memory LRU and sealed once for the daemon and the tier
   (`fills`: in the background; a full queue drops and counts);
4. `sequential`: a sequential read of a multi-block file brings a window of
   blocks with one ranged request, and the next window in the background
   (`prefetch`); `metadata`: the file's version, cached by age, or
   `coldopen`: from the first block's GET, in a directory found cold.

Invariants:
- Never wrong bytes. Keys carry the file version, so a changed remote file
  gets new keys; every cached byte returned was authenticated under this
  volume's key and this exact key string; a read of a version the source no
  longer holds raises ESTALE (`fetch`), never serves or caches other bytes.
- Bounded memory: blocks and chunks share one LRU budget; a coalesced
  request is at most `_window` blocks, at most half the LRU, so a reader's
  window and the one fetched ahead both fit; so do the fill queue and `fetch`'s buffers.
- A read never fails because of the cache: a missing, corrupt, truncated or
  foreign block file, an unhealthy dir, or an unreachable daemon is a miss
  (counted); a bad block is evicted through the daemon and refilled.
- Only the daemon's files are read: a block file is opened without
  following a symlink (O_NOFOLLOW) and without blocking (O_NONBLOCK), and
  used only if it is a regular file owned by the daemon's uid (`hello`);
  anything else counts as a bad block. The daemon itself is believed only
  if SO_PEERCRED shows the expected uid (`daemonclient.peercheck.check_peer`).
- Fork safe: every public call first checks the process; a child (a
  DataLoader worker) builds its parts anew (`_start_process`: caches,
  threads, connections) and drops what it inherited, including queued fills.
- Picklable for spawn/forkserver workers: a pickle holds the constructor's
  arguments (the key file's path, never the key); unpickling builds a new
  Volume, which reads the key file again.

Known limit: a backend without ETags that rewrites a file in place with the
same size within one mtime tick looks unchanged (version = mtime_ns-size).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
import weakref

from ..common.counters import Counters
from ..common.forks import generation as _forks
from ..contract import blockfile, protocol
from ..contract.blockkey import KeyNamer, check_volume_name
from ..daemonclient.link import DaemonLink
from ..sources.backend import Backend
from ..sources.fileinfo import FileInfo, normalize
from ..volumekey import load_key
from ..writer.writefile import WriteFile
from ..writer.writes import WriteOptions
from . import options
from .ahead.hostfill import ByteBudget, HostFill
from .ahead.prefetch import Prefetcher
from .ahead.sequential import SEQ_START, SequentialReads
from .handle import FileHandle
from .hits.blockfds import BlockFiles
from .hits.blockhits import HitReader
from .hits.chunkhits import ChunkCache, ChunkedHits
from .hits.ciphers import Ciphers
from .hits.decrypt import ParallelDecrypt
from .hits.memory import BlockMemory
from .misses.coldopen import ColdOpens
from .misses.fetch import Fetcher
from .misses.fills import Sealer
from .misses.metadata import Metadata
from .misses.tier import TierReads
from .parts import ReadParts
from .readpath import ReadPath
from .volumecache import VolumeCache
from .volumefile import VolumeFile
from .volumewrites import VolumeWrites

log = logging.getLogger(__name__)

_IDENT_LIMIT = 1 << 18     # cached (path, version) -> key prefix entries


def _rebuild_volume(args: tuple, storage_options: dict) -> Volume:
    """Unpickle a `Volume`: construct it again in this process."""
    return Volume(*args, **storage_options)


class Volume(VolumeWrites, VolumeCache):
    """A named remote volume read through the host's shared, encrypted block cache,
    and written through staging on the node (`volumewrites`, `writer/`).

    `source` is an fsspec URL (local path, `file://`, `s3://bucket/prefix`,
    chained URLs); `storage_options` go to fsspec (or `fs=` an fsspec filesystem
    already built, `source` then being the root path in it). `socket_path` defaults to
    $BLOCKCACHE_SOCKET or /run/blockcache/blockcached.sock; without a daemon
    every read goes to the backend. `daemon_uid`: the uid the daemon must
    answer as, besides root (default $BLOCKCACHE_DAEMON_UID, else the owner
    of the socket's dir; see `client`). `staging_dir`, `staging_bytes`,
    `upload_part_bytes`, `upload_parallel`: how writes stage and upload
    (`writer.writes.WriteOptions`). All methods are thread-safe.
    """

    def __init__(self, name: str, source: str, key_file: str | int,
                 socket_path: str | None = None, block_size: int = 4 << 20, meta_ttl: float = 60.0,
                 fill_queue_bytes: int = 256 << 20, memory_cache_bytes: int = 64 << 20,
                 daemon_uid: int | None = None, chunk_cache: bool = True,
                 staging_dir: str | None = None, staging_bytes: int = WriteOptions.staging_bytes,
                 upload_part_bytes: int = WriteOptions.upload_part_bytes,
                 upload_parallel: int = WriteOptions.upload_parallel, **storage_options):
        self.name = check_volume_name(name)
        # what a pickle carries to rebuild this volume in another process: the
        # key file's path, never the key
        self._write_options = WriteOptions(staging_dir, staging_bytes, upload_part_bytes,
                                           upload_parallel)
        self._init_args = (name, source, key_file, socket_path, block_size, meta_ttl,
                           fill_queue_bytes, memory_cache_bytes, daemon_uid, chunk_cache,
                           *dataclasses.astuple(self._write_options))
        self._storage_options = dict(storage_options)
        self.block_size = options.check_block_size(name, block_size)
        self.meta_ttl = float(meta_ttl)
        self._volume_key = load_key(key_file)  # (a path, or a descriptor: `load_key`)
        # block names derive from the key too: equal on every host with it, opaque to
        # others; a same-named volume under another key is another namespace
        self.names = KeyNamer(self._volume_key)
        self._chunk_size = options.chunk_size(block_size)
        self.socket_path = socket_path or protocol.default_socket()
        self._daemon_uid = daemon_uid
        self._fill_queue_bytes = fill_queue_bytes
        self._memory_cache_bytes = memory_cache_bytes  # blocks and chunks together
        self._chunk_cache = bool(chunk_cache)
        self._window = options.window(block_size, memory_cache_bytes)
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
        """Build the parts of the read path for this process."""
        self._pid = os.getpid()
        self._fork_gen = _forks[0]
        self.counters = Counters()
        self._idents: dict[tuple[str, str], str] = {}
        self._meta = Metadata(self.backend, self.meta_ttl)
        self._mem = BlockMemory(self._memory_cache_bytes)
        chunks = ChunkCache(self._mem, self._chunk_size, self._chunk_cache)
        self._files = BlockFiles.renew(getattr(self, "_files", None))
        ciphers = Ciphers(self._volume_key, self._chunk_size)
        # the sealer must not reference self, or the link's threads would keep us alive
        seal = Sealer(self._volume_key, self._chunk_size, ciphers, chunks)
        self._link = DaemonLink(self.socket_path, self.counters, seal,
                                self._fill_queue_bytes, client_name=f"volume:{self.name}",
                                daemon_uid=self._daemon_uid, volume=self.name,
                                area_slot_bytes=blockfile.file_size(self.block_size,
                                                                    self._chunk_size))
        # a Volume dropped without close() must not leave its threads reconnecting forever
        weakref.finalize(self, self._link.close, 0.2)
        self._hits = HitReader(self.name, self._chunk_size, self._mem, self._link,
                               self.counters, ciphers, ParallelDecrypt(None, self._chunk_size))
        self._hits.chunks = ChunkedHits(self._hits, chunks, self._files) if chunks.enabled else None
        self._tier = TierReads(self._chunk_size, self._link, self.counters, ciphers,
                               self._hits.scratch)
        self._cold = ColdOpens(self._meta, self.backend, self.block_size, self._hits)
        self._fetcher = Fetcher(self.name, self.backend, self.block_size, self._mem,
                                self._link, self.counters, self._hits.is_cached,
                                self._meta.forget, self._tier, self._cold.found)
        self._prefetcher = Prefetcher(self.block_size, self._window, self._hits,
                                      self._fetcher, self.counters)
        self._sequential = SequentialReads(self.block_size, self._window, self._hits.held,
                                           self._prefetcher.ahead)
        self._path = ReadPath(ReadParts(
            self.name, self.block_size, self._window, self._hits, self._fetcher,
            self._sequential, self._prefetcher, self._files, self._link, self.counters,
            self._chunk_size, self._key_prefix))
        self._start_writes()

    def _live_path(self) -> ReadPath:
        """This process's read path (`_proc`'s checks first)."""
        if self._fork_gen != _forks[0] or self._closed:
            self._proc()
        return self._path

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
            self._writes.close()
            self._prefetcher.shutdown()
            self._hits.decrypt.close()
            self._files.close_all()
            self._link.close()
            self.backend.close()

    def __enter__(self) -> Volume:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self):
        # A spawn/forkserver worker (a DataLoader's) gets a new Volume built
        # from the same arguments: the key is read again from its file there.
        if self._closed or isinstance(self._init_args[2], int):  # (a descriptor is ours)
            raise ValueError(f"cannot pickle volume {self.name}: closed, or keyed by a descriptor")
        return (_rebuild_volume, (self._init_args, self._storage_options))

    # -- metadata ----------------------------------------------------------------

    def stat(self, path: str, max_age: float | None = None) -> FileInfo:
        """Info of `path`, cached up to `meta_ttl` seconds (or `max_age`; 0 = fresh).
        A missing path is remembered as missing as long; the second stat in a
        directory lists the directory once instead (see `reader.metadata`)."""
        self._proc()
        return self._meta.stat(normalize(path), max_age)

    def listdir(self, path: str, max_age: float | None = None) -> list[FileInfo]:
        """Entries of a directory (sorted by name); also fills the stat cache."""
        self._proc()
        return list(self._meta.list(normalize(path), max_age))

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
            # construction, and the dataclass's checks per file opened are
            # skipped (tests/blockcache_client compares it with BlockKey's).
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
            info = self._meta.stat(rel)
        elif not isinstance(info, FileInfo) or info.path != rel:
            raise OSError(errno.EINVAL, f"read {path}: the pinned FileInfo is for "
                                        f"{getattr(info, 'path', info)!r}, not this path")
        if info.is_dir:
            raise IsADirectoryError(errno.EISDIR, f"read {path}: is a directory in volume "
                                                  f"{self.name}")
        return rel, info

    def read(self, path: str, offset: int, size: int, info: FileInfo | None = None) -> bytes:
        """Up to `size` bytes at `offset` (fewer only at end of file). `info`
        pins the version (FUSE passes what it got at open); without it the
        cached metadata is used."""
        self._proc()
        options.check_range(path, offset, size)
        rel, info = self._resolve(path, info)
        return self._read(rel, offset, size, info)

    def _read(self, rel: str, offset: int, size: int, info: FileInfo,
              out: memoryview | None = None):
        """`read` after its checks: the file version's sequential run
        (`SequentialReads.follow`), then `ReadPath.read`."""
        end = min(offset + size, info.size)
        prefix = self._key_prefix(rel, info.version)
        st = None
        bs = self.block_size
        if self._window > 1 and info.size > bs and offset < end:
            st = self._sequential.follow(prefix, offset, end, (end - 1) // bs > offset // bs)
        return self._path.read(rel, info, prefix, offset, size, st, out)

    def readinto(self, path: str, offset: int, buffer, info: FileInfo | None = None) -> int:
        """Read into a writable buffer; returns the number of bytes stored
        (fewer than its length only at end of file). Cached blocks decrypt
        straight into the buffer. If it raises, the buffer's contents are
        undefined (but never unauthenticated cache bytes)."""
        view = memoryview(buffer).cast("B")
        self._proc()
        options.check_range(path, offset, len(view))
        rel, info = self._resolve(path, info)
        return self._read(rel, offset, len(view), info, view)

    def readinto_nowait(self, path: str, offset: int, buffer, info: FileInfo) -> int | None:
        """`readinto` of a range within one block, only if it needs no wait:
        the block is in the memory LRU (or its chunks are), or its cache
        file's path and bytes are in the kernel's caches. None otherwise (a
        miss, pages not in memory, a bad or short file, a second block, no
        kernel support): nothing is then counted or evicted, and `readinto`
        does the real read and decides. Never touches the backend, never
        blocks on a disk: a thread that must not wait may call it (an open
        handle's reads do so themselves: `FileHandle`'s `blocking`)."""
        view = memoryview(buffer).cast("B")
        self._proc()
        options.check_range(path, offset, len(view))
        rel, info = self._resolve(path, info)
        end = min(offset + len(view), info.size)
        if offset >= end:
            return 0
        if (end - 1) // self.block_size != offset // self.block_size:
            return None
        got = self._path.read_nowait(rel, info, self._key_prefix(rel, info.version), offset,
                                     view[:end - offset])
        return got if got == end - offset else None

    def open(self, path: str, mode: str = "rb") -> VolumeFile | WriteFile:
        """A read-only binary file object (read, readinto, seek, tell) pinned
        to the version of `path` seen now (`metadata`, or `coldopen`); or,
        with mode "wb" / "w+b", a file staged then uploaded whole on close
        (`writer.writefile`)."""
        if mode != "rb":
            return self._open_write(path, mode)
        # A path the metadata cache holds fresh is canonical, so a dataset
        # opening the paths it listed skips `normalize` and `_resolve`.
        if type(path) is str and self._fork_gen == _forks[0] and not self._closed:
            info = self._meta.cached(path)
            if info is not None and not info.is_dir:
                return VolumeFile(self._handle(path, info))
        rel = normalize(path)
        self._proc()
        got = self._cold.open(rel, self._key_prefix, self._fetcher.keep)
        return VolumeFile(self._handle(rel, *(got or self._resolve(rel, None)[1:])))

    def open_handle(self, path: str, info: FileInfo | None = None, *,
                    seq_start: int = SEQ_START, from_zero: bool = True, ahead_blocks: int = 0,
                    on_ahead=None) -> FileHandle:
        """An open handle of `path` pinned to `info` (default: the version
        seen now): what `open`'s file object reads through, for a caller
        that keeps its own position (the FUSE client). `seq_start`,
        `from_zero`, `ahead_blocks`, `on_ahead`: see `FileHandle`."""
        rel, info = self._resolve(path, info)
        return self._handle(rel, info, None, seq_start=seq_start, from_zero=from_zero,
                            ahead_blocks=ahead_blocks, on_ahead=on_ahead)

    def _handle(self, rel: str, info: FileInfo, first: bytes | None = None,
                **how) -> FileHandle:
        return FileHandle(self._live_path, rel, info, first, chunk_size=self._chunk_size, **how)

    def host_fill(self, budget: ByteBudget, cancelled: threading.Event) -> HostFill:
        """What `prefetch_ahead` puts files into the host cache with, in this
        process (`hostfill`)."""
        key, chunk = self._volume_key, self._chunk_size

        def seal(block_key: str, data: bytes) -> memoryview:  # (`seal` without its copy)
            return blockfile.seal_into(block_key, data, key, chunk)[0]
        return HostFill(self._live_path().parts, seal, self.socket_path, self._daemon_uid,
                        budget, cancelled)

    def wait_fills(self, timeout: float = 10.0) -> bool:
        """Block until the background fetches are done (`prefetch`, a
        sequential read's windows: each may still fetch, or wait for and
        count another reader's fill) and the fills queued reached the daemon
        and the tier (tests, warmup), those of uploaded files included.
        False if `timeout` passed first."""
        self._proc()
        deadline = time.monotonic() + timeout
        return (self._prefetcher.wait_idle(timeout)
                and self._writes.written.wait(max(0.0, deadline - time.monotonic()))
                and self._link.wait_idle(max(0.0, deadline - time.monotonic()))
                and self._tier.wait(max(0.0, deadline - time.monotonic())))

    def stats(self) -> dict:
        """Counters of this process's reads (see `counters.VOLUME_COUNTERS`) plus
        the link state."""
        self._proc()
        out: dict = self.counters.snapshot()
        out["daemon_connected"] = self._link.connected
        out["layout_epoch"] = self._link.layout_epoch
        out["fill_queue_bytes"] = self._link.pending_fill_bytes()
        out["memory_bytes"] = self._mem.used  # blocks and chunks: at most memory_cache_bytes
        out.update(chunk_bytes=self._mem.chunk_bytes, open_block_files=len(self._files),
                   **self._fetcher.stats(), **self._hits.decrypt.stats(),
                   **self._writes.stats())
        return out
