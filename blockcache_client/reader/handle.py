"""An open file: everything about reading one pinned file version, in one object.

`Volume.open`'s file object (`volumefile`) and the FUSE client's open
handles (`fsclient/handles.py`) read through a `FileHandle`. It owns:

- the version: the `FileInfo` pinned at open, and its block key prefix;
- one sequential detector (`sequential.Stream`): every read of the handle
  is noted once; a sequential run brings windows of blocks
  (`SequentialReads.plan`), issued at least `ahead_blocks` past each block
  the run crosses (the FUSE mount's `readahead_blocks`; a file read in one
  block or without windows gets those blocks fetched one by one);
- the chunk path of random reads: its repeat hits of kept chunks are served
  from the held block files (`handlehits`) without the read path, and
  `read_around` reads the whole chunks around a small read (a FUSE reply
  whose other pages go to the kernel's page cache);
- read-ahead's cancellation: `cancel_ahead` (a seek elsewhere) and `close`
  drop the run's background fetches not yet sent;
- the memory it holds: the block files held open for it (`blockfds`), and
  the first block a cold open brought (`coldopen`), until its first read.

Waits: a caller that must not wait without saying so (a FUSE worker, which
hands its channel to another thread first) passes `blocking`, a context
manager factory. The read is then tried on what needs no wait (the memory
LRU, the kernel's caches), each chunk it answers decrypted once; only the
blocks that would wait are read inside `blocking()`. Without it the read
simply waits.

Not thread-safe: one read at a time, or the caller's lock (fsclient reads a
sequential run outside its handle lock: racing reads of one run can only
make the detector's guess worse, never a read wrong).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ..sources.fileinfo import FileInfo
from .ahead.sequential import SEQ_START, Stream
from .hits.blockhits import deliver
from .hits.chunks import CHUNKED_READ_MAX
from .hits.handlehits import HandleBlocks
from .readpath import ReadPath

Blocking = Callable[[], contextlib.AbstractContextManager]


class FileHandle:
    """Reads of one open file version (see the module)."""

    __slots__ = ("rel", "info", "size", "chunk_size", "_live", "_path", "_prefix",
                 "_blocks", "_stream", "_first", "_seq_start", "_from_zero", "_ahead",
                 "_on_ahead", "_ahead_until", "_tracked")

    def __init__(self, live: Callable[[], ReadPath], rel: str, info: FileInfo,
                 first: bytes | None = None, *, chunk_size: int, seq_start: int = SEQ_START,
                 from_zero: bool = True, ahead_blocks: int = 0,
                 on_ahead: Callable[[], None] | None = None) -> None:
        """`live()`: this process's read path (a forked child builds its own;
        a closed volume raises). `first`: block 0's bytes from a cold open's
        GET. `seq_start`, `from_zero`: when a read starts a run
        (`SequentialReads.note`). `ahead_blocks`: blocks fetched ahead of a
        run, `on_ahead` called at each such fetch."""
        self.rel = rel
        self.info = info
        self.size = info.size
        self.chunk_size = chunk_size
        self._live = live
        path = self._path = live()
        parts = path.parts
        self._prefix = parts.key_prefix(rel, info.version)
        self._blocks = HandleBlocks(parts.hits, parts.key_prefix, parts.block_size, rel, info)
        self._stream = Stream()
        self._first = first
        self._seq_start = seq_start
        self._from_zero = from_zero
        self._ahead = ahead_blocks
        self._on_ahead = on_ahead
        self._ahead_until = 0
        # the run plans windows only where one request may bring several blocks
        self._tracked = parts.window > 1 and info.size > parts.block_size

    # -- the detector ----------------------------------------------------------

    def note(self, pos: int, size: int) -> bool:
        """Note a read of [pos, pos + size) in the handle's detector: True if
        it continues a sequential run (which then fetches `ahead_blocks`
        ahead). `read` notes its read itself unless told `noted`."""
        path = self._path
        if not path.parts.sequential.note(self._stream, pos, pos + size, self._seq_start,
                                          self._from_zero):
            self._ahead_until = 0
            return False
        if self._ahead and not self._tracked:  # (a tracked run's: `_run_ahead`)
            self._read_ahead(path, pos)
        return True

    def _read_ahead(self, path: ReadPath, pos: int) -> None:
        """Fetch the `ahead_blocks` after the block at `pos` in the
        background, block by block (an untracked handle: no windows)."""
        bs = path.parts.block_size
        first = (pos // bs + 1) * bs
        end = min(self.size, first + self._ahead * bs)
        start = max(first, self._ahead_until)
        if start >= end:
            return
        self._ahead_until = end
        if self._on_ahead is not None:
            self._on_ahead()
        path.parts.prefetcher.ahead(self.rel, self.info, self._prefix, start, end,
                                    self._stream)

    def cancel_ahead(self) -> None:
        """End the run: its background fetches not yet sent are dropped."""
        self._stream.cancel()
        self._ahead_until = 0

    # -- reads -------------------------------------------------------------------

    def read(self, pos: int, size: int, out: memoryview | None = None,
             blocking: Blocking | None = None, noted: bool = False):
        """Bytes [pos, pos + size) of the file (fewer only at its end), or
        their count stored in `out`. `blocking`: see the module; `noted`: the
        caller noted this read already (`note`)."""
        path = self._live()
        if path is not self._path:  # a forked child: its own parts, no files held
            self._renew(path)
        end = min(pos + size, self.size)
        if pos >= end:
            return b"" if out is None else 0
        if self._first is not None:
            got = self._read_first(path, pos, end, out)
            if got is not None:
                return got
        streaming = self._stream.streaming if noted else self.note(pos, size)
        if not streaming:  # a repeat hit of kept chunks: no read path
            got = self._blocks.read(pos, end - pos, out)
            if got is not None:
                return got
        bs = path.parts.block_size
        st = None
        if self._tracked and (streaming or (end - 1) // bs != pos // bs):
            st = self._stream
        issued = self._stream.issued
        got = path.read(self.rel, self.info, self._prefix, pos, end - pos, st, out,
                        self._blocks, blocking)
        if streaming and self._tracked:
            self._run_ahead(path, pos, issued)
        return got

    def _run_ahead(self, path: ReadPath, pos: int, issued: int) -> None:
        """After a read of a tracked run, which fetches by windows
        (`SequentialReads.plan`): where `ahead_blocks` after `pos` pass the
        last window issued, the next window comes, in parts (never a request
        per block); `on_ahead` once the run issued more (from `issued`)."""
        st = self._stream
        if self._ahead:
            until = pos // path.parts.block_size + 1 + self._ahead
            path.parts.sequential.extend(st, self.rel, self.info, self._prefix, until)
        if st.issued > issued and self._on_ahead is not None:
            self._on_ahead()

    def read_around(self, pos: int, size: int,
                    blocking: Blocking | None = None) -> tuple[int, memoryview]:
        """A random read of [pos, pos + size) as the whole chunks around it:
        (where they start, their bytes). It decrypts those chunks anyway,
        and asking for all of them keeps them as one run (`chunks.spans`),
        so a later read of another page of them is a lookup. Larger than
        `CHUNKED_READ_MAX`: just the range. Noted by the caller (`note`)."""
        c = self.chunk_size
        lo = pos - pos % c
        hi = min(self.size, pos + size + -(pos + size) % c)
        if hi - lo > CHUNKED_READ_MAX:
            lo, hi = pos, pos + size
        return lo, memoryview(self.read(lo, hi - lo, None, blocking, noted=True))

    def read_nowait(self, pos: int, out: memoryview) -> int | None:
        """`read` into `out` of what needs no wait; None unless all of it
        (up to the file's end) did, and then nothing was counted for the
        block that would wait."""
        path = self._live()
        if path is not self._path:
            self._renew(path)
        want = max(0, min(len(out), self.size - pos))
        got = path.read_nowait(self.rel, self.info, self._prefix, pos, out[:want])
        return got if got == want else None

    def _read_first(self, path: ReadPath, pos: int, end: int, out: memoryview | None):
        """The first read, from the open's block 0 if it lies within it,
        counted as the miss it is; else None (the block is in the memory
        LRU too)."""
        data, self._first = self._first, None
        if end > len(data):
            return None
        path.parts.counters.add2("misses", "miss_bytes", end - pos)
        return deliver(data, pos, end, out)

    def _renew(self, path: ReadPath) -> None:
        """The process forked: the parent's parts (and held files) are not ours."""
        self._path = path
        parts = path.parts
        self._blocks = HandleBlocks(parts.hits, parts.key_prefix, parts.block_size, self.rel,
                                    self.info)
        self._stream = Stream()

    def close(self) -> None:
        """Cancel the read-ahead, let go of the block files held and the
        cold open's block."""
        self._first = None
        self._stream.cancel()
        self._blocks.close(self._path.parts.files)
