"""Files on one cache dir. Every method here does blocking I/O and runs on
that dir's worker thread (see `filler`), never on the event loop.

    <dir>/blockcached.lock      flock held by the running daemon
    <dir>/blocks/<xx>/<yy>/<key>  complete block files, 0644 (readers in pods)
    <dir>/tmp/<pid>.<n>         in-flight writes

A block is written to tmp/ and renamed to its final name, so a crash of the
daemon at any point leaves either no file or the complete file under the key;
leftovers in tmp/ are deleted at start. Blocks are not fsynced: this is a
read cache, whose every byte can be fetched again, and readers authenticate
every chunk, so what an OS crash or power loss can leave (a short, empty or
torn file under a block name) is a miss, never wrong bytes (DESIGN.md,
"Why blocks are not fsynced"). Paths come only from
`blockcache_client.layout`, from keys that `BlockKey.parse` accepted.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import pickle
import shutil
import subprocess
import sys
from array import array
from dataclasses import dataclass
from typing import Iterator

from blockcache_client import blockfile, layout
from blockcache_client.keys import _KEY_RE, MAX_INODE

log = logging.getLogger(__name__)

FILE_MODE = 0o644
DIR_MODE = 0o755
# The smallest valid block file: a header and one tag (an empty block).
MIN_BLOCK_FILE = blockfile.HEADER_SIZE + blockfile.TAG_SIZE
_HEX2 = frozenset(f"{i:02x}" for i in range(256))


@dataclass(slots=True)
class Run:
    """Blocks found by one scanner, as columns sorted by mtime (oldest first;
    mtimes in ns: their nanoseconds carry the policy's frequency, see `policy`).

    Columns rather than a tuple per file: at millions of files, tuples built
    in the daemon would be left behind as fragmented heap (measured: +160 B
    of RSS per entry). Sorting happens in the scanner (a child process for
    big dirs), so the daemon never materializes a sort over all entries.
    """

    names: list[str]
    mtimes: array
    sizes: array

    @classmethod
    def sorted_from(cls, names: list[str], mtimes: array, sizes: array) -> "Run":
        order = sorted(range(len(names)), key=mtimes.__getitem__)
        return cls([names[j] for j in order], array("q", (mtimes[j] for j in order)),
                   array("q", (sizes[j] for j in order)))


@dataclass(slots=True)
class ScanResult:
    """What a scan of one dir found: sorted runs, and counts."""

    runs: list[Run]
    scanned: int
    removed: int

    def __len__(self) -> int:
        return sum(len(r.names) for r in self.runs)

    def oldest_first(self) -> Iterator[tuple[int, str, int]]:
        """(mtime_ns, key, size) of every block, oldest first, one at a time."""
        return heapq.merge(*(zip(r.mtimes, r.names, r.sizes) for r in self.runs))

    @classmethod
    def merge(cls, parts: list["ScanResult"]) -> "ScanResult":
        return cls([r for p in parts for r in p.runs], sum(p.scanned for p in parts),
                   sum(p.removed for p in parts))


@dataclass(frozen=True, slots=True)
class FsSpace:
    free_bytes: int
    free_inodes: int


class Store:
    """One cache dir on disk."""

    def __init__(self, path: str):
        self.path = path
        self.blocks = os.path.join(path, layout.BLOCKS_DIR)
        self.tmp = os.path.join(path, layout.TMP_DIR)
        self._names = itertools.count()
        # fan-out leaf dirs (by their 16-bit index) this process made or found:
        # a put into one of them renames at once; into another it makes the
        # dir first, instead of failing a rename and an mkdir of the top dir
        self._leaves = bytearray(1 << 16)

    def prepare(self) -> None:
        """Create the dir skeleton (0755) if missing."""
        for d in (self.path, self.blocks, self.tmp):
            _makedir(d)

    def lock_path(self) -> str:
        return os.path.join(self.path, layout.LOCK_FILE)

    def block_path(self, key: str) -> str:
        """`<dir>/blocks/xx/yy/<key>`, built without os.path.join: it is on
        every lookup hit."""
        return f"{self.path}/{layout.block_relpath(key)}"

    def write(self, key: str, data: bytes | memoryview) -> None:
        """Write one block: tmp file, then rename into place (no fsync: see
        the module docstring)."""
        fan = layout.fanout(key)
        final = f"{self.blocks}/{fan}/{key}"
        tmp = f"{self.tmp}/{os.getpid()}.{next(self._names)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, FILE_MODE)  # umask must not hide blocks from readers
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        leaf = int(fan[:2] + fan[3:], 16)
        try:
            if not self._leaves[leaf]:
                _makedir(f"{self.blocks}/{fan}")
                self._leaves[leaf] = 1
            try:
                os.rename(tmp, final)
            except FileNotFoundError:  # removed behind our back: make it again
                _makedir(f"{self.blocks}/{fan}")
                os.rename(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise

    def unlink(self, key: str) -> None:
        _unlink(self.block_path(key))

    def touch_times(self, keys: list[tuple[str, int]]) -> None:
        """Set mtimes (ns) so a restart restores approximate LRU order, and
        the policy's frequency in their nanoseconds (`policy.encode_mtime_ns`)."""
        for key, ns in keys:
            try:
                os.utime(self.block_path(key), ns=(ns, ns))
            except FileNotFoundError:
                pass  # evicted meanwhile

    def space(self) -> FsSpace:
        st = os.statvfs(self.path)
        return FsSpace(st.f_bavail * st.f_frsize, st.f_favail)

    def probe(self) -> None:
        """Write, read back and delete a small file through tmp/ and blocks/;
        raises OSError if the dir is not usable. Recreates the skeleton
        first, so a fresh disk mounted in its place is taken into use."""
        self.prepare()
        tmp = os.path.join(self.tmp, f"probe.{os.getpid()}")
        dst = os.path.join(self.blocks, ".probe")
        payload = os.urandom(64)
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, dst)
        with open(dst, "rb") as f:
            if f.read() != payload:
                raise OSError(5, "probe file read back different bytes", dst)
        os.unlink(dst)

    def clear_tmp(self) -> int:
        """Delete every leftover in tmp/ (writes a crash interrupted)."""
        n = 0
        with os.scandir(self.tmp) as it:
            for e in it:
                _unlink(e.path)
                n += 1
        return n

    def scan(self, placement: Placement | None, me: int, processes: int = 1) -> ScanResult:
        """Find the complete blocks this dir owns (see `_scan_tops`).

        With `processes` > 1 and a populated fan-out, the top-level fan-out
        dirs are split over that many child processes: the scan is CPU-bound
        in Python (parse, hash, stat per file), so threads would not help.
        """
        tops = [e.path for e in _subdirs(self.blocks)]
        if processes > 1 and _populated(tops):
            log.info("scanning %s with %d processes", self.path, processes)
            try:
                return ScanResult.merge(_scan_in_children(
                    [(tops[i::processes], placement, me) for i in range(processes)]))
            except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as exc:
                log.warning("parallel scan of %s failed (%s); scanning in one thread", self.path, exc)
        return _scan_tops(tops, placement, me)


# A child imports only this module (not the daemon's __main__, as a
# multiprocessing spawn would): its start-up is a fraction of the scan.
_CHILD = "from blockcached.store import scan_child; scan_child()"


def _scan_in_children(jobs: list[tuple[list[str], "Placement | None", int]]) -> list[ScanResult]:
    """Run `_scan_tops` for each job in its own Python process, at once."""
    procs = []
    # the child must import the same blockcached as this process
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        for job in jobs:
            p = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, close_fds=True, env=env)
            procs.append(p)
            assert p.stdin is not None
            p.stdin.write(pickle.dumps(job))
            p.stdin.close()
        results = []
        for p in procs:  # each writes its whole result then exits; read them in turn
            assert p.stdout is not None
            data = p.stdout.read()
            if p.wait() != 0:
                raise RuntimeError(f"scan process exited with {p.returncode}")
            results.append(pickle.loads(data))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def scan_child() -> None:
    """Entry of a scan process: a pickled job on stdin, its ScanResult on stdout."""
    tops, placement, me = pickle.loads(sys.stdin.buffer.read())
    sys.stdout.buffer.write(pickle.dumps(_scan_tops(tops, placement, me),
                                         protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.flush()


# The dirs' (path, weight) for rendezvous placement; None = one dir owns all.
Placement = tuple[tuple[str, int], ...]


# A fan-out this populated (top dirs, and leaf dirs under the first) has
# enough files to be worth starting processes for.
PARALLEL_MIN_TOPS = 64
PARALLEL_MIN_MIDS = 64


def _populated(tops: list[str]) -> bool:
    return len(tops) >= PARALLEL_MIN_TOPS and len(_subdirs(tops[0])) >= PARALLEL_MIN_MIDS


def _scan_tops(tops: list[str], placement: Placement | None, me: int) -> ScanResult:
    """Scan `blocks/<top>/*/*` for each top; the blocks kept, oldest first.

    Does not open files (restart must be fast): a file is kept if its name is
    a canonical key (`is_block_name`), it sits at that key's fan-out path,
    this dir owns it under `placement`, and its size could be a block file.
    Everything else is deleted. Corrupt contents are caught by readers, which
    authenticate every chunk and evict what fails.
    """
    names: list[str] = []
    mtimes = array("q")
    sizes = array("q")
    scanned = removed = 0
    fanout = layout.fanout
    owner = None
    if placement is not None:
        owner = layout.Layout([layout.CacheDir(p, w) for p, w in placement]).dir_index
    for top in tops:
        top_name = os.path.basename(top)
        for mid in _subdirs(top):
            where = f"{top_name}/{mid.name}"
            with os.scandir(mid.path) as it:
                for e in it:
                    scanned += 1
                    name = e.name
                    ok = (is_block_name(name) and fanout(name) == where
                          and (owner is None or owner(name) == me))
                    if ok:
                        st = e.stat(follow_symlinks=False)
                        ok = (e.is_file(follow_symlinks=False)
                              and MIN_BLOCK_FILE <= st.st_size <= _MAX_FILE)
                    if ok:
                        names.append(name)
                        mtimes.append(st.st_mtime_ns)
                        sizes.append(st.st_size)
                    else:
                        log.info("scan: removing %s (not a block this dir owns)", e.path)
                        _remove_any(e.path)
                        removed += 1
    return ScanResult([Run.sorted_from(names, mtimes, sizes)], scanned, removed)


def is_block_name(name: str) -> bool:
    """Whether `BlockKey.parse(name)` would accept `name`, without building a
    BlockKey: the key pattern, and an inode below 2**63 (the pattern allows
    19 digits). A third of the scan's time per file went to parse."""
    m = _KEY_RE.fullmatch(name)
    return m is not None and (len(m[2]) < 19 or int(m[2]) <= MAX_INODE)


_MAX_FILE = blockfile.BlockHeader(b"\0" * 8, b"\0" * 16, blockfile.MAX_PLAINTEXT,
                                  blockfile.MIN_CHUNK).file_size


def _subdirs(path: str):
    """Fan-out dirs (two lowercase hex digits) under `path`, skipping others."""
    try:
        with os.scandir(path) as it:
            dirs = [e for e in it if e.name in _HEX2 and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    return dirs


def _makedir(path: str) -> None:
    """mkdir -p, every dir it makes 0755 whatever the umask (readers in pods
    list them)."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if not parent or parent == path:
            raise
        _makedir(parent)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            return
    os.chmod(path, DIR_MODE)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_any(path: str) -> None:
    try:
        os.unlink(path)
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
    except FileNotFoundError:
        pass
