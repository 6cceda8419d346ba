"""One file being written: its bytes staged on the node, sealed as cached blocks are.

Layout: the file is cut into units of `UNIT` plaintext bytes; unit i is
stored at i x `stride` of the staging file (`staging.StagingArea.new_file`)
as a block file (`contract/blockfile`: AES-256-GCM, a subkey from the
volume key by HKDF with a random salt, the volume's chunk size). Each seal
draws a new salt, so a unit sealed again after a seek back never reuses a
nonce under a key; the key string a unit is sealed under (its AAD) names
this staged file and the unit, so a unit moved elsewhere fails
authentication. A unit never written is a hole: zeros, and no disk.

In memory: up to `KEPT_UNITS` units as plaintext, least recently used
first out; writes and reads land there. A write covering a whole unit is
sealed straight from the caller's bytes; a unit leaving memory is sealed to
disk. So sequential writes cost one seal per unit whatever their sizes,
and a seek back to patch a header (zipfile, tarfile) one unseal and seal.

Bound: a unit counts `stride` bytes against the `StagingArea` from the
write that first touches it until a truncate drops it or the file is
disposed; a write that would pass the bound fails with ENOSPC before it
changes anything.

Concurrency: `lock` (re-entrant) orders writes, reads, truncates and a
commit, which holds it for the whole upload (a write waits for it, as on a
local disk's fsync): after `flush`, `snapshot` gives the uploader's threads
reads of the sealed units that take no lock. `generation` changes with
every change, so a background reader (the cache fill of what was
uploaded) can tell the bytes it reads are still the ones uploaded.
"""

from __future__ import annotations

import collections
import errno
import os
import secrets
import threading
from collections.abc import Callable

from ..contract import blockfile
from ..contract.blockfile import HEADER_SIZE, BlockCipher, key_id
from ..contract.errors import FormatError, IntegrityError
from .staging import StagingArea

UNIT = 1 << 20
KEPT_UNITS = 4
_ZEROS = bytes(UNIT)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class StagedFile:
    """The staged bytes of one file (see the module doc)."""

    def __init__(self, area: StagingArea, volume_key: bytes, chunk_size: int, rel: str):
        self.rel = rel
        self.area = area
        self.volume_key = volume_key
        self.key_id = key_id(volume_key)
        self.chunk_size = chunk_size
        self.stride = blockfile.file_size(UNIT, chunk_size)
        self.ident = secrets.token_hex(8)
        self.fd = area.new_file()
        self.lock = threading.RLock()
        self.size = 0
        self.generation = 0
        self.unsaved = True            # changed since the last upload (a new file: yes)
        self.sealed: dict[int, int] = {}   # unit on disk -> its plaintext length
        self._mem: collections.OrderedDict[int, bytearray] = collections.OrderedDict()
        self._dirty: set[int] = set()
        self._held: set[int] = set()   # units counted against the area
        self._seal_buf = bytearray()
        self._scratch = bytearray()
        self.disposed = False
        # told (under `lock`) of each change, [lo, hi) (hi None: from lo on):
        # the parts sent ahead (`streaming.Stream.changed`)
        self.on_change: Callable[[int, int | None], None] | None = None

    def _check(self) -> None:
        if self.disposed:
            raise ValueError(f"staged file {self.rel} is closed")

    def unit_key(self, i: int) -> str:
        return f"staged:{self.ident}:{i}"

    # -- changes -----------------------------------------------------------------

    def write(self, offset: int, data) -> int:
        """Write `data` at `offset` (any offset: a gap reads as zeros)."""
        view = memoryview(data).cast("B")
        n = len(view)
        if offset < 0:
            raise OSError(errno.EINVAL, f"write {self.rel}: negative offset {offset}")
        if n == 0:
            return 0
        end = offset + n
        with self.lock:
            self._check()
            new = [i for i in range(offset // UNIT, (end - 1) // UNIT + 1)
                   if i not in self._held]
            if new:
                self.area.reserve(len(new) * self.stride, self.rel)
                self._held.update(new)
            self.size = max(self.size, end)
            self.generation += 1
            self.unsaved = True
            if self.on_change is not None:
                self.on_change(offset, end)
            pos = offset
            while pos < end:
                i = pos // UNIT
                base = i * UNIT
                lo, hi = pos - base, min(UNIT, end - base)
                piece = view[pos - offset:pos - offset + hi - lo]
                if lo == 0 and hi == UNIT:
                    self._forget(i)
                    self._seal(i, piece)
                else:
                    self._unit(i)[lo:hi] = piece
                    self._dirty.add(i)
                pos = base + hi
        return n

    def truncate(self, size: int) -> None:
        """Cut or extend the file to `size` bytes (an extension reads as zeros)."""
        if size < 0:
            raise OSError(errno.EINVAL, f"truncate {self.rel}: negative size {size}")
        with self.lock:
            self._check()
            self.generation += 1
            self.unsaved = True
            if self.on_change is not None:
                self.on_change(min(size, self.size), None)
            if size < self.size:
                cut = size // UNIT if size % UNIT == 0 else size // UNIT + 1
                for i in [i for i in self._held if i >= cut]:
                    self._drop(i)
                if size % UNIT:  # the unit the new end is in: zeros after it
                    i, keep = size // UNIT, size % UNIT
                    if i in self._mem or self.sealed.get(i, 0) > keep:
                        buf = self._unit(i)
                        buf[keep:] = _ZEROS[keep:]
                        self._dirty.add(i)
                os.ftruncate(self.fd, cut * self.stride)
            self.size = size

    def _drop(self, i: int) -> None:
        self._forget(i)
        self.sealed.pop(i, None)
        self._held.discard(i)
        self.area.release(self.stride)

    def _forget(self, i: int) -> None:
        """Drop unit i's plaintext from memory, unsealed (it is being replaced)."""
        if self._mem.pop(i, None) is not None:
            self._dirty.discard(i)

    # -- units -------------------------------------------------------------------

    def _unit(self, i: int) -> bytearray:
        """Unit i's plaintext in memory (loaded, or zeros), most recent now."""
        buf = self._mem.get(i)
        if buf is not None:
            self._mem.move_to_end(i)
            return buf
        spare = None
        while len(self._mem) >= KEPT_UNITS:
            spare = self._evict()
        buf = spare if spare is not None else bytearray(UNIT)
        n = self.sealed.get(i, 0)
        if n:
            self.open_unit(i, n, memoryview(buf), self._scratch_for(n))
        if n < UNIT and spare is not None:
            buf[n:] = _ZEROS[n:]
        self._mem[i] = buf
        return buf

    def _scratch_for(self, n: int) -> bytearray:
        need = blockfile.file_size(n, self.chunk_size)
        if len(self._scratch) < need:
            self._scratch = bytearray(self.stride)
        return self._scratch

    def _evict(self) -> bytearray:
        i, buf = self._mem.popitem(last=False)
        if i in self._dirty:
            self._dirty.discard(i)
            self._seal(i, memoryview(buf))
        return buf

    def _seal(self, i: int, plaintext: memoryview) -> None:
        """Unit i to disk, holding the file's bytes in it (none past the end)."""
        n = min(UNIT, self.size - i * UNIT)
        if n <= 0:
            self.sealed.pop(i, None)
            return
        blob, _ = blockfile.seal_into(self.unit_key(i), plaintext[:n], self.volume_key,
                                      self.chunk_size, self._seal_buf)
        self._seal_buf = blob.obj
        _pwrite_all(self.fd, blob, i * self.stride)
        self.sealed[i] = n

    def flush(self) -> None:
        """Seal every unit changed in memory (kept there, clean)."""
        with self.lock:
            self._check()
            for i in sorted(self._dirty):
                self._seal(i, memoryview(self._mem[i]))
            self._dirty.clear()

    def open_unit(self, i: int, n: int, out: memoryview, scratch: bytearray) -> None:
        """Unit i's `n` sealed bytes, authenticated, into out[:n]; OSError(EIO)
        if the staging disk lost or changed them."""
        size = blockfile.file_size(n, self.chunk_size)
        view = memoryview(scratch)[:size]
        got = 0
        while got < size:
            k = os.preadv(self.fd, [view[got:]], i * self.stride + got)
            if k <= 0:
                break
            got += k
        try:
            if got != size:
                raise FormatError(f"{got} of its {size} bytes are there")
            cipher = BlockCipher.from_head(view[:HEADER_SIZE], self.unit_key(i),
                                           self.volume_key, self.key_id)
            if cipher.plaintext_len != n:
                raise FormatError(f"it holds {cipher.plaintext_len} bytes, not {n}")
            cipher.read_range_into(0, view[HEADER_SIZE:], out[:n])
        except (FormatError, IntegrityError) as exc:
            raise OSError(errno.EIO, f"staged bytes of {self.rel} (unit {i}) are not as "
                                     f"written: {exc}") from None

    # -- reads -------------------------------------------------------------------

    def read(self, offset: int, size: int) -> bytearray:
        """Up to `size` bytes at `offset` (fewer only at the end of the file)."""
        with self.lock:
            self._check()
            end = min(offset + size, self.size)
            out = bytearray(max(0, end - offset))
            view = memoryview(out)
            pos = offset
            while pos < end:
                i = pos // UNIT
                base = i * UNIT
                lo, hi = pos - base, min(UNIT, end - base)
                if i in self._mem or self.sealed.get(i, 0) > lo:
                    view[pos - offset:pos - offset + hi - lo] = self._unit(i)[lo:hi]
                pos = base + hi  # a hole: already zeros
            return out

    def snapshot(self) -> Snapshot:
        """Lock-free reads of the file as sealed now (call `flush` first, and
        hold `lock` while the snapshot is read: nothing may change it)."""
        return Snapshot(self, dict(self.sealed), self.size)

    def dispose(self) -> None:
        """Free the staged bytes (closing the nameless file frees its disk)."""
        with self.lock:
            if self.disposed:
                return
            self.disposed = True
            os.close(self.fd)
            self.area.release(len(self._held) * self.stride)
            self._held.clear()
            self._mem.clear()
            self._dirty.clear()
            self.sealed.clear()


class Snapshot:
    """The sealed units of a staged file at one moment, read without its lock."""

    def __init__(self, staged: StagedFile, sealed: dict[int, int], size: int):
        self.staged = staged
        self.sealed = sealed
        self.size = size

    def read_into(self, offset: int, out: memoryview, scratch: bytearray) -> None:
        """Bytes [offset, offset + len(out)) into `out`; `offset` a multiple of
        UNIT; `scratch` (the calling thread's own) holds a sealed unit."""
        if offset % UNIT:
            raise ValueError(f"snapshot reads start at a unit, not at {offset}")
        pos = 0
        while pos < len(out):
            i = (offset + pos) // UNIT
            want = min(UNIT, len(out) - pos)
            n = self.sealed.get(i, 0)
            if n > want:  # flush leaves no unit holding bytes past the end
                raise ValueError(f"unit {i} holds {n} bytes, past the {want} read")
            if n:
                self.staged.open_unit(i, n, out[pos:pos + n], scratch)
            if n < want:
                out[pos + n:pos + want] = _ZEROS[n:want]
            pos += want
