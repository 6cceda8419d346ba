"""The start-up scan of a cache dir: which files under `blocks/` are
complete blocks this dir owns (kept, with their mtimes and sizes) and which
are not (deleted). A big dir's fan-out is split over child processes, since
the scan is CPU-bound Python; each child imports only this module.
Runs on the dir's worker thread (see `filler`), never on the event loop.
It also makes every fan-out dir `TREE_MODE`: a tree an older daemon left
listable (0755) is closed at the first restart.
"""

from __future__ import annotations

import heapq
import logging
import os
import pickle
import shutil
import subprocess
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from blockcache_client.contract import blockfile, layout
from blockcache_client.contract.blockkey import is_block_name

log = logging.getLogger(__name__)

# blocks/ and its fan-out dirs: traversable, not listable (readers compute
# paths and never list, so a tenant cannot list another's block names)
TREE_MODE = 0o711
# The smallest valid block file: a header and one tag (an empty block).
MIN_BLOCK_FILE = blockfile.HEADER_SIZE + blockfile.TAG_SIZE
_HEX2 = frozenset(f"{i:02x}" for i in range(256))


@dataclass(slots=True)
class Run:
    """Blocks found by one scanner, as columns sorted by mtime (oldest first;
    mtimes in ns: their nanoseconds carry the policy's frequency, see `policy`).

    Columns rather than a tuple per file: at millions of files, tuples built
    in the daemon would be left behind as fragmented heap. Sorting happens in
    the scanner (a child process for big dirs), so the daemon never
    materializes a sort over all entries.
    """

    names: list[str]
    mtimes: array
    sizes: array

    @classmethod
    def sorted_from(cls, names: list[str], mtimes: array, sizes: array) -> Run:
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
    def merge(cls, parts: list[ScanResult]) -> ScanResult:
        return cls([r for p in parts for r in p.runs], sum(p.scanned for p in parts),
                   sum(p.removed for p in parts))


def scan_blocks(path: str, blocks: str, placement: Placement | None, me: int,
                processes: int = 1) -> ScanResult:
    """Find the complete blocks the cache dir at `path` owns in its `blocks`
    tree (see `_scan_tops`).

    With `processes` > 1 and a populated fan-out, the top-level fan-out
    dirs are split over that many child processes: the scan is CPU-bound
    in Python (parse, hash, stat per file), so threads would not help.
    Symlinks where fan-out dirs belong are removed (`_subdirs`).
    """
    links = [0]
    tops = [e.path for e in _subdirs(blocks, links)]
    unlinked = links[0]
    if processes > 1 and _populated(tops):
        log.info("scanning %s with %d processes", path, processes)
        try:
            result = ScanResult.merge(_scan_in_children(
                [(tops[i::processes], placement, me) for i in range(processes)]))
            result.removed += unlinked
            return result
        except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as exc:
            log.warning("parallel scan of %s failed (%s); scanning in one thread",
                        path, exc)
    result = _scan_tops(tops, placement, me)
    result.removed += unlinked
    return result


# A child imports only this module (not the daemon's __main__, as a
# multiprocessing spawn would): its start-up is a fraction of the scan.
_CHILD = "from blockcached.scan import scan_child; scan_child()"


def _scan_in_children(jobs: list[tuple[list[str], Placement | None, int]]) -> list[ScanResult]:
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
    return len(tops) >= PARALLEL_MIN_TOPS and len(_subdirs(tops[0], None)) >= PARALLEL_MIN_MIDS


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
    links = [0]
    owner = None
    if placement is not None:
        owner = layout.Layout([layout.CacheDir(p, w) for p, w in placement]).dir_index
    for top in tops:
        top_name = os.path.basename(top)
        _tree_mode(top)
        for mid in _subdirs(top, links):
            _tree_mode(mid.path)
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
    return ScanResult([Run.sorted_from(names, mtimes, sizes)], scanned, removed + links[0])


_MAX_FILE = blockfile.BlockHeader(b"\0" * 8, b"\0" * 16, blockfile.MAX_PLAINTEXT,
                                  blockfile.MIN_CHUNK).file_size


def _tree_mode(path: str) -> None:
    """Make a fan-out dir TREE_MODE, through a descriptor that follows no link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # gone, or not a dir: the scan's other checks deal with it
    try:
        if os.fstat(fd).st_mode & 0o777 != TREE_MODE:
            os.fchmod(fd, TREE_MODE)
    finally:
        os.close(fd)


def _subdirs(path: str, links: list[int] | None):
    """Fan-out dirs (two lowercase hex digits) under `path`, skipping others.
    With `links`, symlinks there are removed (only dirs belong in the
    fan-out: a link would take the scan or a put out of the tree), and
    counted in links[0]."""
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except FileNotFoundError:
        return []
    dirs = []
    for e in entries:
        if e.is_symlink():
            if links is not None:
                log.info("scan: removing symlink %s", e.path)
                _remove_any(e.path)
                links[0] += 1
        elif e.name in _HEX2 and e.is_dir(follow_symlinks=False):
            dirs.append(e)
    return dirs


def _remove_any(path: str) -> None:
    try:
        os.unlink(path)
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
    except FileNotFoundError:
        pass
