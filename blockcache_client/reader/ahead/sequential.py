"""Sequential reads: how many blocks one request to the source may bring.

Each request to the source has a fixed cost (tens of ms on S3), so a
sequential reader is served with few large requests. A read is sequential
(tracked per file version in this process) when it is `SEQ_START` or more
at offset 0, or starts at most the slack (an eighth of a block, at most
`SEQ_SLACK`) after where the run's reads ended: at once for large reads,
from the third small read of the run (two steps forward). A read starting
at most the slack before that end is a late request of the run: it neither
counts nor breaks it. Its miss brings a window of blocks nobody has yet: the
read waits for the window's first part (`options.PART_BYTES`), the other
parts come in parallel in the background; half way through a window the
next one is fetched in the background, in parts too (`prefetch`). A read
spanning several blocks brings its own blocks with one request; any other
read (random 4 KiB) brings its block only.

A reader that closes its file or seeks away `cancel`s the run: its
background fetches not yet sent are dropped (`prefetch`), so a reader that
stops mid-file leaves no more than the requests already in flight.
"""

from __future__ import annotations

from collections.abc import Callable

from ...sources.fileinfo import FileInfo
from ..options import part_blocks

SEQ_START = 256 << 10     # a read this large at offset 0 (or continuing one) is sequential
# "continues the previous read": starts this close to its end (the reader
# caps it at an eighth of a block; a FUSE mount's kernel readahead requests
# come concurrently, slightly out of order)
SEQ_SLACK = 512 << 10
STREAMS_LIMIT = 4096      # per-file sequential-read states kept before starting over


class Stream:
    """The read pattern of one file version in this process: where the last
    read ended, how many reads in a row continued the one before, whether the
    current read is sequential, and the first block no request covers yet."""

    __slots__ = ("next_off", "streak", "streaming", "issued", "epoch")

    def __init__(self) -> None:
        self.next_off = -1
        self.streak = 0
        self.streaming = False
        self.issued = 0
        self.epoch = 0  # one more at each cancel: fetches planned before it are dropped

    def cancel(self) -> None:
        """End the run: what it planned and did not send is dropped."""
        self.epoch += 1
        self.next_off, self.streak, self.streaming, self.issued = -1, 0, False, 0

    def advance(self, offset: int, end: int, slack: int) -> bool:
        """Note a read of [offset, end): True if it belongs to the run. One
        that starts up to `slack` after where the run's reads ended makes the
        streak one longer; one that starts up to `slack` before it is a late
        request of the run (FUSE's concurrent readahead), which neither
        lengthens nor breaks it: small random reads near each other are no
        stream, however they fall."""
        gap = offset - self.next_off
        if self.next_off >= 0 and -slack <= gap <= slack:
            if gap >= 0:
                self.streak += 1
            if end > self.next_off:
                self.next_off = end
            return True
        self.streak = 0
        self.next_off = end
        return False


class SequentialReads:
    """Stream detection and window planning for one volume in one process.

    `has_block(key)`: the block is in memory or on the cache disk.
    `fetch_ahead(rel, info, prefix, start, end, stream)`: fetch [start, end)
    in the background unless `stream` is cancelled first."""

    def __init__(self, block_size: int, window: int, has_block: Callable[[str], bool],
                 fetch_ahead: Callable[[str, FileInfo, str, int, int, Stream], object]):
        self.block_size = block_size
        self.window = window
        self.part = part_blocks(block_size)
        self._slack = min(SEQ_SLACK, block_size // 8)
        self._has_block = has_block
        self._fetch_ahead = fetch_ahead
        self._streams: dict[str, Stream] = {}  # by key prefix (file version)

    def follow(self, prefix: str, offset: int, end: int, multi: bool) -> Stream | None:
        """Track the read pattern of one file version; its `Stream` if this
        read may fetch more than the block it misses (a sequential read, or
        one spanning several blocks), else None. Racing threads on one file
        can only make the guess worse, never a read wrong."""
        st = self._streams.get(prefix)
        if st is None:
            if len(self._streams) >= STREAMS_LIMIT:
                self._streams.clear()
            st = self._streams[prefix] = Stream()
        return st if self.note(st, offset, end) or multi else None

    def note(self, st: Stream, offset: int, end: int, start: int = SEQ_START,
             from_zero: bool = True) -> bool:
        """Note a read of [offset, end) in `st` (one open handle's, or one file
        version's): True if it is sequential. `start`: a read this large
        continuing the run is sequential at once; `from_zero`: so is one at
        offset 0 (a FUSE mount's first read is the kernel's readahead, not
        yet a run)."""
        big = end - offset >= start
        if st.advance(offset, end, self._slack):
            # a random small read may land next to the last one by chance:
            # only a third one in a row (or a large one) makes it a stream
            st.streaming = st.streak >= 2 or big
        else:
            st.streaming = from_zero and offset == 0 and big
            b = offset // self.block_size
            # a new run: nothing fetched for it yet, unless it starts inside
            # the last window issued (a mapped file's faults read around
            # themselves, so its run breaks and resumes): that stays issued,
            # or each resumption would send a window over the last one
            if not st.issued - self.window <= b < st.issued:
                st.issued = b
        return st.streaming

    def extend(self, st: Stream, rel: str, info: FileInfo, prefix: str,
               until: int | None = None) -> bool:
        """Fetch the run's next window in the background (in parts, from
        `st.issued`), or windows until block `until` is issued; True if one
        was. A run fetched ahead block by block would send one request per
        block: ahead of a run is always whole windows."""
        bs = self.block_size
        nblocks = -(-info.size // bs)
        want = min(nblocks, st.issued + 1 if until is None else until)
        if st.issued >= want:
            return False
        start = st.issued
        st.issued = min(nblocks, max(want, start + self.window))
        self._fetch_ahead(rel, info, prefix, start * bs, min(info.size, st.issued * bs), st)
        return True

    def cancel(self, prefix: str) -> None:
        """Stop the read-ahead of one file version (its reader closed or sought)."""
        st = self._streams.get(prefix)
        if st is not None:
            st.cancel()

    def plan(self, st: Stream, rel: str, info: FileInfo, prefix: str, b: int,
             last: int) -> int:
        """How many blocks from block `b` one request may fetch if `b` is a
        miss. A sequential reader gets a window, and the next window is
        fetched in the background once half of this one is read; a
        non-sequential multi-block read gets just its own blocks."""
        win = self.window
        if not st.streaming:
            return min(win, last + 1 - b)
        bs = self.block_size
        nblocks = -(-info.size // bs)
        if b >= st.issued:
            st.issued = min(nblocks, b + win)
            if not self._has_block(prefix + format(b * bs, "016x")):
                first = min(self.part, st.issued - b)  # the miss waits for one part
                if st.issued > b + first:  # and the window's other parts come meanwhile
                    self._fetch_ahead(rel, info, prefix, (b + first) * bs,
                                      min(info.size, st.issued * bs), st)
                return first
            if st.issued > b + 1:  # a hit: the rest of the window in the background
                self._fetch_ahead(rel, info, prefix, (b + 1) * bs,
                                  min(info.size, st.issued * bs), st)
            return 1
        if st.issued - b <= win // 2:
            self.extend(st, rel, info, prefix)
        # a miss here (the background job is still queued, or the block was
        # evicted) brings the rest of its part; blocks that job already
        # claimed stop the run, so nothing is fetched twice
        return min(self.part, st.issued - b)
