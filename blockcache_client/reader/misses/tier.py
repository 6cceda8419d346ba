"""The reader's use of the cluster tier: after the local cache, before the remote.

- A read inside a block larger than one slice (`run` 1, not from the block's
  start) takes only the slices its chunks are in, with one multi-get, and
  decrypts just its range; the block stays where it is (a 4 KiB random read
  of a 4 MiB block moves one or two items, under 1 MiB).
- Any other miss (a block's start: a scan begins there; a sequential window)
  takes whole blocks: every slice of each, one multi-get per server. Each
  block is authenticated whole, kept in the memory LRU and handed, sealed as
  it came (no re-encryption), to the local daemon, so the next read on this
  host is a local hit; its cipher is kept, as the daemon stores these bytes.
  Its items land in a slot of the link's fill area when one is free, so the
  hand-off is a put by reference: the daemon writes the block file from the
  slot (no copy through the socket).
- A block read from the remote reaches the tier from the daemon link's fill
  thread, which seals it once for both (`offer`): split into items and queued
  for `add` on the pool's filler (bounded, drops and counts when full).
- Every item is authenticated like a block file (AES-GCM with the header and
  the key string as AAD, the chunk index in the nonce; `cluster.items` checks
  shape and size first). A forged, foreign, truncated or misplaced item is
  counted (`cluster_bad`), the block's items are deleted from the tier, and
  the read goes to the remote: never served.
- No exception leaves a tier read: a server's failure is handled by the
  pool, anything else is logged and counted (`cluster_errors`), and the
  remote answers.

The tier is on while the daemon's `hello` names a pool (`DaemonLink.cluster`).
"""

from __future__ import annotations

import logging

from ...cluster.items import Geometry, Landing, fits, item_key, split
from ...cluster.pool import Pool, pool_for
from ...common.counters import Counters
from ...contract.blockfile import TAG_SIZE, chunk_span
from ...contract.cluster import ClusterConfig
from ...contract.errors import FormatError, IntegrityError
from ...daemonclient.link import DaemonLink
from ...daemonclient.readerarea import Slot
from ..hits.blockhits import Scratch
from ..hits.ciphers import Ciphers

log = logging.getLogger(__name__)


class TierReads:
    """One volume's reads from, and fills of, the cluster tier."""

    def __init__(self, chunk_size: int, link: DaemonLink, counters: Counters,
                 ciphers: Ciphers, scratch: Scratch):
        self._chunk = chunk_size
        self._link = link
        self.counters = counters
        self.ciphers = ciphers
        self._scratch = scratch  # plaintext is decrypted there, then copied out once
        # where items land: reused once a range is read, or a block's bytes
        # are handed to the daemon (`offer_fill`'s done)
        self._landings = Scratch()
        self._cfg: ClusterConfig | None = None
        self._pool: Pool | None = None
        link.on_sealed = self.offer  # one seal (on the fill thread) for the daemon and the tier
        self.pool()  # now, not on a first read: a DNS name is resolved at once

    def pool(self) -> Pool | None:
        """The pool the daemon names now, or None (no tier)."""
        cfg = self._link.cluster
        if cfg is None:
            return None
        if cfg is not self._cfg:
            self._pool, self._cfg = pool_for(cfg), cfg
        return self._pool

    def ranged(self, blen: int, lo: int, run: int) -> bool:
        """Whether a miss of [lo, ...) in a block of `blen` bytes takes only
        its slices: a random read inside a block of several slices."""
        return run == 1 and lo > 0 and Geometry(blen, self._chunk).count > 1

    # -- reads ----------------------------------------------------------------------

    def read_range(self, key: str, blen: int, lo: int, hi: int, out: memoryview | None):
        """Plaintext [lo, hi) of `key`'s block from the slices holding it (bytes,
        or its length once stored in `out`), or None: not there or not authentic."""
        pool = self.pool()
        if pool is None or not fits(key):
            return None
        chunk = self._chunk
        geo = Geometry(blen, chunk)
        first, end = chunk_span(blen, chunk, lo, hi - lo)
        try:
            landing = Landing(key, geo, geo.slices(first, end), self._landings.take)
            try:
                return self._read_landing(pool, key, landing, lo, hi, first, end, out)
            finally:
                self._landings.give(landing.room)
        except Exception as exc:  # the remote answers instead
            self._broken(key, exc)
            return None

    def _read_landing(self, pool: Pool, key: str, landing: Landing, lo: int, hi: int,
                      first: int, end: int, out: memoryview | None):
        """`read_range` once its slices' places are chosen."""
        geo, chunk = landing.geo, self._chunk
        got = pool.get_into({key: landing.sizes}, landing.place, self.counters,
                            bad=lambda k, why: self._bad(pool, k, geo, why))
        if len(got) != len(landing.names):
            self.counters.add("cluster_misses")
            return None
        n = hi - lo
        scratch = self._scratch.take(n) if out is None else None
        try:
            head, body = landing.open()
            cipher = self.ciphers.cipher(key, head, geo.blen)
            skip = (first - landing.wanted[0] * geo.per) * (chunk + TAG_SIZE)
            span = min(end * chunk, geo.blen) - first * chunk + (end - first) * TAG_SIZE
            target = (out if scratch is None else scratch)[:n]
            cipher.read_range_into(lo, body[skip:skip + span], target)
            result = n if scratch is None else target.tobytes()
        except (FormatError, IntegrityError) as exc:
            self._bad(pool, key, geo, exc)
            return None
        finally:
            if scratch is not None:
                self._scratch.give(scratch)
        self.counters.add2("cluster_hits", "cluster_bytes", landing.received)
        return result

    def blocks(self, wanted: list[tuple[str, int]]) -> dict[str, bytes]:
        """The whole blocks found authentic in the tier, by key, from
        [(key, block length)]: each also handed sealed to the daemon. Each
        item is checked and decrypted as it lands, while the later ones
        arrive (`_Arrival`)."""
        pool = self.pool()
        wanted = [(k, blen) for k, blen in wanted if fits(k)]
        if pool is None or not wanted:
            return {}
        try:
            return self._blocks(pool, wanted)
        except Exception as exc:  # the remote answers instead
            self._broken(wanted[0][0], exc)
            return {}

    def _blocks(self, pool: Pool, wanted: list[tuple[str, int]]) -> dict[str, bytes]:
        """`blocks` once the pool and the blocks to ask for are known."""
        arrivals = {k: self._whole(k, blen) for k, blen in wanted}
        by_name = {name: a for a in arrivals.values() for name in a.landing.names}
        try:
            got = pool.get_into({k: a.landing.sizes for k, a in arrivals.items()},
                                lambda name, size: by_name[name].landing.place(name, size),
                                self.counters, lambda name: by_name[name].landed(name),
                                lambda k, why: self._bad(pool, k, arrivals[k].landing.geo, why))
            found = {}
            for k, a in arrivals.items():
                if not got.issuperset(a.landing.names):
                    self.counters.add("cluster_misses")
                elif a.error is not None:
                    self._bad(pool, k, a.landing.geo, a.error)
                else:
                    found[k] = a.plain[:a.landing.geo.blen].tobytes()
                    self.counters.add2("cluster_hits", "cluster_bytes", a.landing.received)
                    a.handed = self._hand_off(k, a)
        finally:
            for a in arrivals.values():
                self._scratch.give(a.plain)
                if a.handed:  # its buffer comes back through `offer_fill`'s done
                    continue
                if a.slot is not None:
                    a.slot.give()
                else:
                    self._landings.give(a.landing.room)
        return found

    def _whole(self, key: str, blen: int) -> _Arrival:
        """Where all of a block's items land: in a fill area slot if one is
        free (the block will be handed to the daemon from there)."""
        slot = None

        def room(n: int) -> memoryview:
            nonlocal slot
            slot = self._link.take_slot(n)
            return slot.view if slot is not None else self._landings.take(n)

        geo = Geometry(blen, self._chunk)
        landing = Landing(key, geo, range(geo.count), room)
        return _Arrival(self, key, landing, slot, self._scratch.take(blen))

    def _hand_off(self, key: str, a: _Arrival) -> bool:
        """Give an authentic block's file to the daemon as it came: by
        reference from its slot, else by value (its buffer reused once sent).
        False if there is no daemon to give it to."""
        if a.slot is not None:  # the daemon frees the slot
            self._link.offer_fill(key, a.landing.buf, sealed=True, done=a.slot.give, slot=a.slot)
        elif self._link.connected:
            room = a.landing.room
            self._link.offer_fill(key, a.landing.buf, sealed=True,
                                  done=lambda: self._landings.give(room))
        else:
            return False
        return True

    def _broken(self, key: str, exc: Exception) -> None:
        """Whatever went wrong in a tier read (a server's reply no check
        foresaw, a bug of ours) is a miss, counted: never the reader's error."""
        self.counters.add("cluster_errors")
        log.warning("cluster tier read of block %s failed (%s: %s); reading the remote",
                    key, type(exc).__name__, exc, exc_info=True)

    def _bad(self, pool: Pool, key: str, geo: Geometry, why: object) -> None:
        """Count an item that is not an authentic slice of this block and
        delete the block's items (a later fill stores it anew)."""
        self.counters.add("cluster_bad")
        log.warning("cluster tier item of block %s is bad (%s); deleting it and reading the "
                    "remote", key, why)
        pool.delete(key, [item_key(key, i) for i in range(geo.count)], self.counters)

    # -- fills ----------------------------------------------------------------------

    def offer(self, key: str, blob: bytes | memoryview) -> None:
        """A block just sealed for the daemon (the link's fill thread): queue it
        for the tier too. Never blocks; a full queue drops and counts."""
        pool = self.pool()
        if pool is None or not fits(key):
            return
        try:
            items = split(key, blob)  # copies: the sealer reuses its buffer
        except FormatError as exc:  # our own seal: not expected
            log.error("cannot cut block %s into tier items: %s", key, exc)
            return
        pool.offer_fill(key, items, self.counters)

    def wait(self, timeout: float) -> bool:
        """Until this process's queued tier fills are stored (tests, warmup)."""
        pool = self.pool()
        return pool is None or pool.wait_fills(timeout)


class _Arrival:
    """One whole block being read from the tier: each item, as it lands, is
    checked and its chunks decrypted into `plain`; the first failure is
    kept in `error` and the rest is not decrypted."""

    __slots__ = ("tier", "key", "landing", "slot", "plain", "slices", "error", "handed")

    def __init__(self, tier: TierReads, key: str, landing: Landing, slot: Slot | None,
                 plain: memoryview):
        self.tier = tier
        self.key = key
        self.landing = landing
        self.slot = slot  # the fill area slot the items land in (else landing.room)
        self.plain = plain
        self.slices: set[int] = set()
        self.error: Exception | None = None
        self.handed = False  # given to the daemon: its buffer is the link's now

    def landed(self, name: str) -> None:
        if self.error is not None:
            return
        landing = self.landing
        geo = landing.geo
        try:
            i, body = landing.check(name)
            if i in self.slices:
                raise FormatError(f"slice {i} arrived twice")
            cipher = self.tier.ciphers.cipher(self.key, landing.header, geo.blen)
            first, end = geo.chunks(i)
            lo = first * geo.chunk
            cipher.read_range_into(lo, body, self.plain[lo:min(end * geo.chunk, geo.blen)])
            self.slices.add(i)
        except (FormatError, IntegrityError) as exc:
            self.error = exc
