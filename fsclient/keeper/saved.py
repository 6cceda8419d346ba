"""The session state that outlives a server process: a memfd that the keeper
holds beside the FUSE connection and hands to every server.

The kernel names nodes by id only, and an id (`Volume.inode(path)`) is a keyed
hash that cannot be inverted: a server that takes a live connection over must
learn the path of every id the kernel may still send. The kernel holds an id
while its lookup count is above zero, so the counts are kept here too: the
record of an id the kernel has let go of can then be dropped, and the state
stays the size of what the kernel holds, not of every path ever looked up.
The first server also keeps the INIT terms here, which its successors never
see again.

Layout (little-endian). The memfd is sparse: only written pages take memory.

    header  [0, PAGE)  MAGIC (14 bytes), u16 FORMAT_VERSION, u64 offset of the live log
    log     region 0 [PAGE, PAGE + REGION) or region 1 (the REGION after it):
            records, each u32 length of body, u32 crc32 of body, body; a zero
            length ends the log
    body    u8 kind, then
              TERMS (1): the `Negotiated` terms as JSON (the last one wins)
              NODE  (2): u64 node id, u32 slot, the node's volume path
                         (surrogateescape UTF-8)
    counts  [COUNTS, COUNTS + 4 * MAX_SLOTS)  u32 per slot: the kernel's
            lookups of the node whose record names that slot

What must hold, and why it does:
- Every id the kernel holds has a NODE record in the live log whose count is
  above zero and never below the kernel's. A lookup raises the count (and
  writes the record, for an id without one) before the reply that hands the
  id to the kernel; a forget lowers it after the kernel let go. A reply the
  kernel never took, or a forget lost with a dead server, leaves a count too
  high: a record kept too long, never one missing.
- A record whose count is zero is dead: the kernel holds no such id. Once the
  dead records weigh as much as the live ones (and 1 MiB), a thread
  (`_compact`) writes the live records into the other region, copies after
  them what was appended meanwhile, then points the header at it (one write
  within a page: a server killed before it leaves the old log live, after it
  the new one), then frees the old region. A dead record looked up again
  meanwhile is appended anew, so the new log misses no id. A dead record's
  slot is reused only after the switch, when no record names it any more.
- A torn last record (a server killed mid-write) is ignored by `load`, zeroed
  and written over.
- One server writes at a time (the keeper hands the memfd on only after the
  server before has exited); within a server, `_lock` orders the writes.

Format 1 (every path, no counts, records from byte 16) is rewritten as format
2 by the first server that loads it, into region 1, each node with the count
UNKNOWN: its record is never dropped, as format 1 dropped none.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import threading
import zlib

from ..session.negotiate import Negotiated

log = logging.getLogger(__name__)

MAGIC = b"FSCLIENT-SAVED"
FORMAT_VERSION = 2
HEADER = struct.Struct("<14sHQ")
VERSION_AND_LOG = struct.Struct("<HQ")  # the header's last two fields, written at once
RECORD = struct.Struct("<II")
NODE = struct.Struct("<BQI")
NODE_V1 = struct.Struct("<BQ")
TERMS, NODE_KIND = 1, 2

PAGE = mmap.PAGESIZE
REGION = 16 << 30     # a log region: ~200M records of 80 bytes
MAX_SLOTS = 1 << 30   # nodes the kernel may hold at once
COUNTS = PAGE + 2 * REGION
SIZE = COUNTS + 4 * MAX_SLOTS
UNKNOWN = 1 << 31     # the count of a node from format 1: never reaches zero
COMPACT_MIN = 1 << 20  # dead bytes below this are left where they are


class SavedStateError(Exception):
    """The memfd does not hold a saved session of this format."""


def create() -> int:
    """A new, empty saved-state memfd (close-on-exec: it travels by SCM_RIGHTS)."""
    fd = os.memfd_create("fsclient-saved", os.MFD_CLOEXEC)
    os.ftruncate(fd, SIZE)
    os.pwrite(fd, HEADER.pack(MAGIC, FORMAT_VERSION, PAGE), 0)
    return fd


class SavedState:
    """The records of one mount's memfd: read once when a server starts, then
    written by that server alone."""

    def __init__(self, fd: int):
        self.fd = fd
        self.terms: Negotiated | None = None
        self.paths: dict[int, str] = {}  # the ids the kernel may hold
        self.torn = 0  # bytes of a torn last record found by `load`
        self.compactions = 0
        self._slots: dict[int, int] = {}  # id -> its slot, for every record in the log
        self._free: list[int] = []  # slots no record names
        self._next_slot = 0
        self._dead = 0  # about the bytes of records whose count is zero
        self._lock = threading.Lock()
        self._compactor: threading.Thread | None = None
        self._kept: dict[int, int] | None = None  # while compacting: the ids it writes
        self._appended: set[int] = set()  # while compacting: ids appended after them
        self._dead_kept = 0  # while compacting: bytes of its records dead since it began
        self._version = FORMAT_VERSION
        self._map, self._counts = self._open()
        self._log = self._end = PAGE
        self._load()

    def _open(self) -> tuple[mmap.mmap, memoryview]:
        head = os.pread(self.fd, HEADER.size, 0)
        if len(head) < 16:
            raise SavedStateError("the saved FUSE session is empty; remount")
        magic, self._version = struct.unpack_from("<14sH", head)
        if magic != MAGIC or self._version not in (1, FORMAT_VERSION):
            raise SavedStateError(f"the saved FUSE session is format {self._version}, not "
                                  f"{FORMAT_VERSION}: another fsclient version made it; remount")
        if os.fstat(self.fd).st_size < SIZE:  # (format 1: as long as its records)
            os.ftruncate(self.fd, SIZE)
        m = mmap.mmap(self.fd, SIZE)
        return m, memoryview(m)[COUNTS:].cast("I")

    # -- reading ---------------------------------------------------------------

    def _load(self) -> None:
        if self._version == 1:
            self._load_v1()
            return
        self._log = HEADER.unpack_from(self._map, 0)[2]
        self._end = self._scan(self._log, self._region_end(self._log), self._apply)
        used = set(self._slots.values())
        self._free = [s for s in range(self._next_slot) if s not in used]

    def _scan(self, off: int, limit: int, apply) -> int:
        """Calls `apply(body, record size)` for each record from `off`: the
        offset after the last good one. A torn one after it is zeroed."""
        m = self._map
        while off + RECORD.size <= limit:
            length, crc = RECORD.unpack_from(m, off)
            start = off + RECORD.size
            if length == 0:
                break
            if start + length > limit or zlib.crc32(m[start:start + length]) != crc:
                self.torn = min(RECORD.size + length, limit - off)
                self._zero(off, self.torn)
                break
            apply(m[start:start + length], RECORD.size + length)
            off = start + length
        return off

    def _apply(self, body: bytes, size: int) -> None:
        if body[0] == TERMS:
            self.terms = Negotiated.from_dict(json.loads(body[1:]))
        elif body[0] == NODE_KIND:
            _, inode, slot = NODE.unpack_from(body)
            self._slots[inode] = slot
            self._next_slot = max(self._next_slot, slot + 1)
            if self._counts[slot]:
                self.paths[inode] = body[NODE.size:].decode("utf-8", "surrogateescape")
            else:
                self._dead += size

    def _load_v1(self) -> None:
        """Format 1's records (from byte 16), written again as format 2 into
        region 1; the header names the new log only once it is whole."""
        def apply(body: bytes, size: int) -> None:
            if body[0] == TERMS:
                self.terms = Negotiated.from_dict(json.loads(body[1:]))
            elif body[0] == NODE_KIND:
                inode = NODE_V1.unpack_from(body)[1]
                self.paths[inode] = body[NODE_V1.size:].decode("utf-8", "surrogateescape")

        self._scan(16, PAGE + REGION, apply)
        for slot, inode in enumerate(self.paths):
            self._slots[inode] = slot
            self._counts[slot] = UNKNOWN
        self._next_slot = len(self._slots)
        self._rewrite(PAGE + REGION)

    # -- writing ---------------------------------------------------------------

    def save_terms(self, terms: Negotiated) -> None:
        self.terms = terms
        with self._lock:
            self._append(bytes([TERMS]) + json.dumps(terms.to_dict()).encode())

    def looked_up(self, inode: int, path: str) -> int:
        """The kernel is about to learn `inode` (`path`) once more: its count,
        raised, recording the path first if the log has no record of it."""
        with self._lock:
            slot = self._slots.get(inode)
            if slot is None:
                slot = self._free.pop() if self._free else self._take_slot()
                self._counts[slot] = 1  # (before the record: a record is never dead-born)
                self._append(NODE.pack(NODE_KIND, inode, slot) + _encode(path))
                self._slots[inode] = slot
                if self._kept is not None:
                    self._appended.add(inode)
                self.paths[inode] = path
                return 1
            count = self._counts[slot]
            if count == 0:  # a dead record comes back to life
                self._dead -= _node_size(path)
                self.paths[inode] = path
                kept = self._kept
                if kept is not None:
                    if inode not in kept and inode not in self._appended:
                        # (the new log leaves it out: it goes into the tail)
                        self._counts[slot] = 1
                        self._append(NODE.pack(NODE_KIND, inode, slot) + _encode(path))
                        self._appended.add(inode)
                        return 1
                    self._dead_kept -= _node_size(path)
            if count < UNKNOWN:
                count += 1
                self._counts[slot] = count
            return count

    def moved(self, inode: int, path: str) -> None:
        """`inode` names `path` from now on (a rename on a writable mount): a
        record of the new path, which a later one wins over in `load`."""
        with self._lock:
            slot = self._slots.get(inode)
            old = self.paths.get(inode)
            if slot is None or old is None or old == path:
                return
            self._append(NODE.pack(NODE_KIND, inode, slot) + _encode(path))
            self._dead += _node_size(old)
            if self._kept is not None and inode in self._kept:
                self._dead_kept += _node_size(old)
            self.paths[inode] = path

    def forgot(self, inode: int, n: int) -> int:
        """The kernel let go of `n` lookups of `inode`: its count left."""
        with self._lock:
            slot = self._slots.get(inode)
            if slot is None:
                return 0
            count = self._counts[slot]
            if count == 0 or count >= UNKNOWN:
                return count
            count = max(0, count - n)
            self._counts[slot] = count
            if count == 0:
                size = _node_size(self.paths.pop(inode))
                self._dead += size
                if self._kept is not None and (inode in self._kept or inode in self._appended):
                    self._dead_kept += size
                if self._compactor is None and self._worth_compacting():
                    self._compactor = threading.Thread(target=self._compact, daemon=True,
                                                       name="fsclient-saved-compact")
                    self._compactor.start()
            return count

    def join(self, timeout: float | None = None) -> None:
        """Wait for a compaction under way to end."""
        compactor = self._compactor
        if compactor is not None:
            compactor.join(timeout)

    def lookups(self, inode: int) -> int:
        """The kernel's lookups of `inode` as counted here (0: it holds none)."""
        slot = self._slots.get(inode)
        return self._counts[slot] if slot is not None else 0

    def size(self) -> int:
        """Bytes of the live log (its records and the header's page)."""
        return PAGE + self._end - self._log

    def live_bytes(self) -> int:
        """Bytes of the live log's records whose count is above zero."""
        return self._end - self._log - self._dead

    def close(self) -> None:
        self._counts.release()
        self._map.close()

    def _take_slot(self) -> int:
        if self._next_slot >= MAX_SLOTS:
            raise OSError(f"the saved FUSE session holds {MAX_SLOTS} nodes, its most")
        self._next_slot += 1
        return self._next_slot - 1

    def _append(self, body: bytes) -> None:
        record = RECORD.pack(len(body), zlib.crc32(body)) + body
        if self._end + len(record) + RECORD.size > self._region_end(self._log):
            raise OSError("the saved FUSE session's log region is full")
        self._map[self._end:self._end + len(record)] = record
        self._end += len(record)

    def _compact(self) -> None:
        """Write the live records into the other region and switch to it, until
        the dead ones weigh less than the live. It runs beside lookups and
        forgets (its lock is held only to take the live set and to switch):
        records appended meanwhile are copied after the live ones, and a dead
        record looked up again meanwhile is appended anew (`looked_up`), so the
        new log misses no id the kernel holds."""
        try:
            while self._compact_once():
                pass
        except Exception:
            log.exception("compacting the saved FUSE session failed; it stays as it was")
        finally:
            with self._lock:
                self._kept = self._compactor = None

    def _worth_compacting(self) -> bool:
        return self._dead >= COMPACT_MIN and self._dead * 2 >= self._end - self._log

    def _compact_once(self) -> bool:
        """One compaction; whether another is due (records died meanwhile)."""
        with self._lock:
            other = PAGE + REGION if self._log == PAGE else PAGE
            kept = {inode: self._slots[inode] for inode in self.paths}
            self._kept, self._appended, mark = kept, set(), self._end
            self._dead_kept = 0
            terms, paths = self.terms, dict(self.paths)
        data = self._encode_log(terms, ((i, kept[i], p) for i, p in paths.items()))
        self._free_region(other)  # (no bytes of its last use after the new end)
        self._map[other:other + len(data)] = data
        with self._lock:
            tail = self._map[mark:self._end]
            end = other + len(data) + len(tail)
            self._map[other + len(data):end] = tail
            self._switch(other, end)
            kept.update((i, self._slots[i]) for i in self._appended)
            self._free.extend(s for i, s in self._slots.items() if i not in kept)
            self._slots, self._dead = kept, self._dead_kept
            self.compactions += 1
            return self._worth_compacting()

    def _rewrite(self, region: int) -> None:
        """The log, as `paths`, `_slots` and `terms` say, written at `region`
        and switched to (format 1's conversion: nothing runs beside it)."""
        data = self._encode_log(self.terms, ((i, self._slots[i], p)
                                             for i, p in self.paths.items()))
        self._free_region(region)
        self._map[region:region + len(data)] = data
        self._switch(region, region + len(data))

    @staticmethod
    def _encode_log(terms: Negotiated | None, nodes) -> bytes:
        parts = []
        if terms is not None:
            parts.append(bytes([TERMS]) + json.dumps(terms.to_dict()).encode())
        for inode, slot, path in nodes:
            parts.append(NODE.pack(NODE_KIND, inode, slot) + _encode(path))
        return b"".join(RECORD.pack(len(b), zlib.crc32(b)) + b for b in parts)

    def _switch(self, region: int, end: int) -> None:
        """Make the whole log written at `region` the live one; free the old."""
        old = self._log
        # one write within a page: a kill leaves the header before or after it
        os.pwrite(self.fd, VERSION_AND_LOG.pack(FORMAT_VERSION, region), 14)
        self._log, self._end = region, end
        if old != region:
            self._free_region(old)

    def _free_region(self, region: int) -> None:
        start = PAGE if region < PAGE + REGION else PAGE + REGION
        self._map.madvise(mmap.MADV_REMOVE, start, REGION)

    def _zero(self, off: int, n: int) -> None:
        """Zero [off, off + n): the bytes to the next page, then whole pages freed."""
        page = -(-(off + 1) // PAGE) * PAGE
        self._map[off:min(page, off + n)] = bytes(min(page, off + n) - off)
        if off + n > page:
            self._map.madvise(mmap.MADV_REMOVE, page, -(-(off + n - page) // PAGE) * PAGE)

    @staticmethod
    def _region_end(log: int) -> int:
        return PAGE + REGION if log < PAGE + REGION else PAGE + 2 * REGION


def _encode(path: str) -> bytes:
    return path.encode("utf-8", "surrogateescape")


def _node_size(path: str) -> int:
    return RECORD.size + NODE.size + len(_encode(path))
