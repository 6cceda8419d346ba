"""The walk of one read over its blocks: hits, else the tier or the source.

`Volume.read` and an open handle (`handle`) both read through here, with
their own sequential `Stream` (the volume's per file version, the handle's
its own). Each block is read from `hits` (the memory LRU, kept chunks, the
cache disk), else fetched (`fetch`: the tier, else the source; a sequential
stream's miss brings a window, `sequential.plan`).

`nowait`: only what needs no wait (the memory LRU, the kernel's caches;
`hits`); the read stops at the first block that would wait and says how far
it got, so its caller can wait for the rest in its own `blocking` context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ..common.filledbytes import FilledBytes, release
from ..sources.fileinfo import FileInfo
from .ahead.sequential import Stream
from .hits.handlehits import HandleBlocks
from .parts import ReadParts


class ReadPath:
    """Reads of one volume in one process, block by block."""

    __slots__ = ("parts", "_bs", "_hits", "_fetcher", "_sequential", "_counters")

    def __init__(self, parts: ReadParts) -> None:
        self.parts = parts
        self._bs = parts.block_size
        self._hits = parts.hits
        self._fetcher = parts.fetcher
        self._sequential = parts.sequential
        self._counters = parts.counters

    def read(self, rel: str, info: FileInfo, prefix: str, offset: int, size: int,
             st: Stream | None, out: memoryview | None = None,
             holder: HandleBlocks | None = None,
             blocking: Callable[[], contextlib.AbstractContextManager] | None = None):
        """Up to `size` bytes at `offset` of the version `info` (bytes, or
        their count stored in `out`). `st`: the read's stream if it may fetch
        more than the block it misses (`SequentialReads.follow`), else None.
        `blocking`: each block is tried without a wait first, and the first
        that needs one, and every block after it, is read inside `blocking()`."""
        end = min(offset + size, info.size)
        if offset >= end:
            return b"" if out is None else 0
        bs = self._bs
        first = offset // bs
        last = (end - 1) // bs
        if first == last and st is None:
            boff = first * bs
            if blocking is None:
                return self.block(rel, info, prefix, boff, offset - boff, end - boff, out, 1,
                                  holder)
            with _Waiting(blocking) as waits:
                return self._block_or_wait(waits, rel, info, prefix, boff, offset - boff,
                                           end - boff, out, 1, holder, True)
        if blocking is not None and out is None:  # (bytes of several blocks: FUSE never asks)
            with blocking():
                return self.read(rel, info, prefix, offset, size, st, out, holder)
        with _Waiting(blocking) as waits:
            return self._blocks(rel, info, prefix, offset, end, first, last, st, out, holder,
                                waits)

    def _blocks(self, rel: str, info: FileInfo, prefix: str, offset: int, end: int,
                first: int, last: int, st: Stream | None, out: memoryview | None,
                holder: HandleBlocks | None, waits: _Waiting):
        """`read` of blocks [first, last], for a stream or a read across blocks."""
        bs = self._bs
        chunky = st is None or not st.streaming  # a stream's chunks are not read again
        whole = FilledBytes(end - offset) if out is None and last > first else None
        out = whole.view if whole is not None else out
        got = pos = 0
        for b in range(first, last + 1):  # one block only if `out` is None
            boff = b * bs
            run = 1 if st is None else self._sequential.plan(st, rel, info, prefix, b, last)
            lo, hi = max(offset, boff) - boff, min(end, boff + bs) - boff
            part = None if out is None else out[pos:pos + hi - lo]
            try:
                got = self._block_or_wait(waits, rel, info, prefix, boff, lo, hi, part, run,
                                          holder, chunky)
            finally:
                release(part)  # an idle decrypt helper may still hold it: not the buffer
            pos += hi - lo
        return whole.value() if whole is not None else got if out is None else pos

    def _block_or_wait(self, waits: _Waiting, rel: str, info: FileInfo, prefix: str,
                       boff: int, lo: int, hi: int, out: memoryview | None, run: int,
                       holder: HandleBlocks | None, chunky: bool):
        """`block`, without a wait if it can; else inside the caller's
        `blocking()`, entered once: the rest of the read waits there too."""
        if waits.may_try:
            key = prefix + format(boff, "016x")
            keep = self.wants(key, min(self._bs, info.size - boff), lo, hi, chunky)
            got = self.block(rel, info, prefix, boff, lo, hi, out, run, holder, chunky,
                             nowait=True, keep=keep)
            if got is not None:
                return got
            waits.start()
            return self.block(rel, info, prefix, boff, lo, hi, out, run, holder, chunky,
                              keep=keep)
        return self.block(rel, info, prefix, boff, lo, hi, out, run, holder, chunky)

    def read_nowait(self, rel: str, info: FileInfo, prefix: str, offset: int,
                    out: memoryview, holder: HandleBlocks | None = None,
                    chunky: bool = True) -> int:
        """Bytes of [offset, offset + len(out)) stored in `out` from what
        needs no wait, block by block from the start; fewer than asked (and
        nothing counted for the block that stopped it) where one would wait."""
        end = min(offset + len(out), info.size)
        bs = self._bs
        pos = 0
        while offset + pos < end:
            at = offset + pos
            boff = at - at % bs
            hi = min(end, boff + bs) - boff
            part = out[pos:pos + hi - (at - boff)]
            got = self.block(rel, info, prefix, boff, at - boff, hi, part, 1, holder, chunky,
                             nowait=True)
            release(part)
            if got is None:
                break
            pos += got
        return pos

    def block(self, rel: str, info: FileInfo, prefix: str, boff: int, lo: int, hi: int,
              out: memoryview | None = None, run: int = 1,
              holder: HandleBlocks | None = None, chunky: bool = True, nowait: bool = False,
              keep: bool | None = None):
        """Plaintext [lo, hi) of the block at `boff` (as `hits.deliver`). A
        miss may fetch up to `run` blocks in one request. `holder`: an open
        handle's blocks (`HitReader.read`); `chunky`: not part of a stream,
        so its chunks may be kept (`chunks`). `nowait`: None where the block
        would need a wait (nothing fetched or counted then). `keep`: what
        `wants` said of this read already (a retry after a nowait try)."""
        key = prefix + format(boff, "016x")
        bs = self._bs
        blen = info.size - boff
        blen = blen if blen < bs else bs
        hits = self._hits
        chunks = hits.chunks
        if keep is None:
            keep = self.wants(key, blen, lo, hi, chunky)
        got = hits.read(key, blen, lo, hi, out, nowait, holder, keep)
        if got is not None or nowait:
            return got
        fetched = chunks.fetched if keep else None
        got = self._fetcher.read(rel, info, key, boff, lo, hi, out, run, keep, fetched,
                                 leased=not hits.judged_bad(key))
        if got is None:  # another reader on the host filled it meanwhile: a hit now
            got = hits.read(key, blen, lo, hi, out, False, holder, keep)
            if got is not None:
                return got
            # gone again at once (evicted, its dir out, the daemon lost): fetch it
            # here (never None without a lease: `Fetcher.fetch`)
            got = self._fetcher.read(rel, info, key, boff, lo, hi, out, run, keep, fetched,
                                     leased=False)
        self._counters.add2("misses", "miss_bytes", hi - lo)  # not local: tier or source
        if keep and holder is not None:  # its file is held once this fill lands
            holder.expect(boff // bs)
        return got

    def wants(self, key: str, blen: int, lo: int, hi: int, chunky: bool = True) -> bool:
        """The read of [lo, hi) keeps its chunks (`chunks.ChunkCache.wants`)."""
        chunks = self._hits.chunks
        return chunky and chunks is not None and chunks.cache.wants(key, blen, lo, hi)


class _Waiting:
    """A read's wait: none (no `blocking` given: the read simply waits), or
    the caller's `blocking()`, entered at the first block that needs it."""

    __slots__ = ("_blocking", "_stack")

    def __init__(self, blocking: Callable[[], contextlib.AbstractContextManager] | None):
        self._blocking = blocking
        self._stack: contextlib.ExitStack | None = None

    @property
    def may_try(self) -> bool:
        """A block may still be tried without a wait first."""
        return self._blocking is not None and self._stack is None

    def start(self) -> None:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._blocking())

    def __enter__(self) -> _Waiting:
        return self

    def __exit__(self, *exc) -> bool | None:
        return None if self._stack is None else self._stack.__exit__(*exc)
