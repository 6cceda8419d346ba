"""Misses: blocks read from the cluster tier or the source, once per key
however many threads ask.

`read` serves a miss: a random read inside a large block takes only its
slices from the tier (`tier.TierReads.read_range`); anything else fetches
whole blocks. `fetch` first asks the tier for the block and the following
ones a coalesced read would bring (one multi-get per server; each found
block is kept in memory and handed sealed to the daemon), then reads the
rest from the source.

`fetch` fetches the whole block (single-flight per key), keeps it in the
memory LRU and hands it to the fill queue (sealed and `put` in the
background). A coalesced fetch claims the following blocks nobody has (not
in memory, not on the cache disk, not being fetched) in the single-flight
table first, so a reader wanting one waits for this request; the run stops
at the first block someone has, so it stays contiguous. Then the run is
leased from the daemon (`hostflight`), so a block is fetched once on the
host: the run is cut at the first block another reader is fetching, and a
wanted block another reader is fetching is waited for, then read from the
host cache (`fetch` answers None: "it is in the host cache now"). Each
block is split off and kept, sealed and put under its own key, exactly as
if fetched alone.

The blocks of a multi-block file are received into buffers reused once
nothing refers to them (`buffers`, `common.bufferpool`): a cold large read
then touches no fresh memory per block. Such a block is a read-only
memoryview, not bytes; `hits.deliver` hands the caller bytes either way.

Never wrong bytes: a source answer of the wrong length for the version held,
or (multi-block files, whose blocks are separate ranged reads) a version
that changed by the end of a ranged read, raises ESTALE for every block of
that read instead of any of them being served or cached.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from ...common.bufferpool import BufferPool
from ...common.counters import Counters
from ...daemonclient.link import DaemonLink
from ...sources.backend import Backend
from ...sources.fileinfo import FileInfo
from ..hits.blockhits import deliver
from ..hits.memory import BlockMemory
from ..options import buffer_bytes
from .hostflight import HostFlight, Run
from .singleflight import RETRY, SingleFlight
from .tier import TierReads


class Fetcher:
    """Reads missing blocks of one volume from its source."""

    def __init__(self, name: str, backend: Backend, block_size: int, mem: BlockMemory,
                 link: DaemonLink, counters: Counters, is_cached: Callable[[str], bool],
                 forget_version: Callable[[str], None], tier: TierReads,
                 found_cold: Callable[[str, bool], None]):
        self.name = name
        self.backend = backend
        self.block_size = block_size
        self.mem = mem
        self._link = link
        self.counters = counters
        self._is_cached = is_cached
        self._forget_version = forget_version  # a path whose version changed under us
        self._found_cold = found_cold  # a file's first block came from the source
        self.tier = tier
        self.flight = SingleFlight()
        self.host = HostFlight(link.leases)
        # block buffers kept: up to `options.buffer_bytes` of the LRU's budget; a new
        # one comes with its pages (`bufferpool.populated`), not a fault per page
        self.buffers = BufferPool(block_size, buffer_bytes(mem.capacity), populate=True)

    def read(self, rel: str, info: FileInfo, key: str, boff: int, lo: int, hi: int,
             out: memoryview | None, run: int = 1, transient: bool = False,
             fetched: Callable[[str, bytes, int, int], None] | None = None,
             leased: bool = True):
        """Plaintext [lo, hi) of a block this host does not hold (bytes, or
        its length once stored in `out`): from the tier's slices for a random
        read inside a large block, else from the whole block (`fetch`), which
        `fetched` is shown (the chunk cache keeps the chunks it wants); None
        if another reader on the host filled it meanwhile (read it there),
        never with `leased` False.
        `transient`: for one small random read (see `memory`); `leased`
        False: fetch it without asking the daemon for a lease."""
        blen = min(self.block_size, info.size - boff)
        if self.tier.ranged(blen, lo, run):
            got = self.tier.read_range(key, blen, lo, hi, out)
            if got is not None:
                return got
            # our slices are missing or bad, so the whole block is: the source
            data = self.fetch(rel, info, key, boff, run, ask_tier=False, transient=transient,
                              leased=leased)
        else:
            data = self.fetch(rel, info, key, boff, run, transient=transient, leased=leased)
        if data is None:
            return None
        if fetched is not None:
            fetched(key, data, lo, hi)
        return deliver(data, lo, hi, out)

    def fetch(self, rel: str, info: FileInfo, key: str, boff: int, run: int = 1,
              ask_tier: bool = True, transient: bool = False,
              leased: bool = True) -> bytes | None:
        """The whole block from the tier or the backend, once per key however
        many ask; the same request may bring up to `run` - 1 following blocks.
        None: another reader on the host filled it meanwhile (`hostflight`);
        never with `leased` False, even when this caller joined another
        thread's leased fetch that ended so: then it fetches the block itself."""
        def load() -> bytes | None:
            return self._load(rel, info, key, boff, run, ask_tier, transient, leased)

        while True:
            data, _ = self.flight.do(key, load)
            if data is not None or leased:
                return data

    def stats(self) -> dict:
        """`read_buffer_bytes`: the buffers kept for cold blocks of large files."""
        return {"read_buffer_bytes": self.buffers.kept_bytes}

    def busy(self, key: str) -> bool:
        """Someone is fetching `key` now."""
        return self.flight.busy(key)

    def _load(self, rel: str, info: FileInfo, key: str, boff: int, run: int,
              ask_tier: bool, transient: bool, leased: bool) -> bytes | None:
        """`fetch`'s leader: claim the following blocks nobody here has (up to
        `run` in all, stopping at the first one in memory, on the cache disk or
        being fetched: the range stays contiguous), lease them (`hostflight`),
        read the run this process may fetch with one request, then keep each
        block and hand it to its waiters. A failure (ESTALE included) is every
        claimed block's: none is kept."""
        data = self.mem.get(key)
        if data is not None:  # a leader just before us finished between our checks
            return data
        claims = self._claim(key, boff, self.host.longest(run), info)
        flight = self.host.begin([key, *(k for k, _ in claims)], leased)
        if flight.landed:  # filled by another reader on the host: read it there
            self._give_up(claims, flight)
            return None
        self._give_up(claims[flight.count - 1:], flight)
        claims = claims[:flight.count - 1]
        try:
            if ask_tier and self.tier.pool() is not None:
                data, claims = self._from_tier(info, key, boff, claims, transient, flight)
                if data is not None:
                    return data
            if boff == 0:  # in no cache here: its directory's other files likely neither
                self._found_cold(rel, True)
            stop = min(boff + (len(claims) + 1) * self.block_size, info.size)
            blocks = self.read_source(rel, info, boff, stop)
        except BaseException as exc:
            for k, call in claims:
                self.flight.settle(k, call, error=exc)
            flight.failed()
            raise
        self.keep(key, blocks[0], transient, flight)
        for (k, call), block in zip(claims, blocks[1:]):
            self.keep(k, block, run=flight)
            self.flight.settle(k, call, block)
        if claims:
            self.counters.add("prefetches", len(claims))
        return blocks[0]

    def _claim(self, key: str, boff: int, run: int, info: FileInfo) -> list:
        """Single-flight claims on the blocks after `key` nobody here has, up
        to `run` blocks in all, stopping at the first one someone has."""
        mem = self.mem
        bs = self.block_size
        prefix = key[:-16]
        claims = []
        stop = boff + bs
        while len(claims) + 1 < run and stop < info.size:
            k = prefix + format(stop, "016x")
            if mem.get(k) is not None or self._is_cached(k):
                break
            call = self.flight.claim(k)
            if call is None:
                break
            landed = mem.get(k)
            if landed is not None:  # landed between the check and the claim
                self.flight.settle(k, call, landed)
                break
            claims.append((k, call))
            stop += bs
        return claims

    def _give_up(self, claims: list, flight: Run) -> None:
        """Claimed blocks this request will not bring after all: their
        waiters here ask again, and their leases go."""
        for k, call in claims:
            self.flight.settle(k, call, RETRY)
        flight.drop([k for k, _ in claims])

    def _from_tier(self, info: FileInfo, key: str, boff: int, claims: list,
                   transient: bool, flight: Run) -> tuple[bytes | None, list]:
        """`key`'s block from the tier, asking in the same multi-get for the
        claimed blocks after it; those found are kept in memory (and handed
        to the daemon by the tier). Returns the block (None if not found) and
        the claims the source read that follows still brings: those before
        the first block the tier had (the rest are settled or given up)."""
        bs = self.block_size
        wanted = [(key, min(bs, info.size - boff))]
        wanted += [(k, min(bs, info.size - boff - i * bs)) for i, (k, _) in enumerate(claims, 1)]
        found = self.tier.blocks(wanted)
        for k, block in found.items():
            self.mem.put(k, block, transient and k == key)
        data = found.get(key)
        cut = 0 if data is not None else next(
            (i for i, (k, _) in enumerate(claims) if k in found), len(claims))
        for k, call in claims[cut:]:
            if k in found:
                self.flight.settle(k, call, found[k])
        self._give_up([c for c in claims[cut:] if c[0] not in found], flight)
        return data, claims[:cut]

    def keep(self, key: str, data: bytes, transient: bool = False,
             run: Run | None = None) -> None:
        """A block read from the source: into the memory LRU, and to the
        daemon; its lease in `run` goes at once if the daemon will not get it."""
        self.mem.put(key, data, transient)
        handed = self._link.connected and self._link.offer_fill(key, data)
        if run is not None and not handed:
            run.drop([key])

    def read_source(self, rel: str, info: FileInfo, start: int, stop: int,
                    inline: bool = False) -> list[bytes]:
        """Bytes [start, stop) of `info`'s version, with one request, split
        into blocks; ESTALE if the source no longer holds exactly that.
        `inline`: the request runs on this thread (`Backend._attempts`)."""
        want = stop - start
        backend = self.backend
        bs = self.block_size
        if info.size <= bs:  # one read of one version
            data = [backend.read(rel, start, stop, inline)]
        else:
            # The blocks of a multi-block file come from separate ranged
            # reads: each must be of `info`'s version, or one key could
            # name a block of another version and a pinned reader could
            # mix versions. S3 and local files prove it within the read;
            # other backends stat after it (counted as a version check).
            try:
                data = backend.read_version(rel, start, stop, info.version, piece=bs,
                                            inline=inline, buffers=self.buffers)
            except OSError as exc:
                if exc.errno != errno.ESTALE:
                    raise
                data = None
            if not backend.native_versioned_reads:
                self.counters.add2("backend_requests", "version_checks", 1)
        got = -1 if data is None else sum(map(len, data))
        self.counters.add2("backend_requests", "backend_bytes", max(got, 0))
        if got != want:
            self._forget_version(rel)
            raise OSError(errno.ESTALE, f"read {rel} in volume {self.name}: the file "
                                        f"changed while being read (version {info.version}, "
                                        f"{want} bytes wanted at offset {start}"
                                        f"{'' if data is None else f', {got} read'}); "
                                        f"stat it again and retry")
        return data
