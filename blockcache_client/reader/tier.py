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
- A block read from the remote reaches the tier from the daemon link's fill
  thread, which seals it once for both (`offer`): split into items and queued
  for `add` on the pool's filler (bounded, drops and counts when full).
- Every item is authenticated like a block file (AES-GCM with the header and
  the key string as AAD, the chunk index in the nonce; `cluster.items` checks
  shape and size first). A forged, foreign, truncated or misplaced item is
  counted (`cluster_bad`), the block's items are deleted from the tier, and
  the read goes to the remote: never served.

The tier is on while the daemon's `hello` names a pool (`DaemonLink.cluster`).
"""

from __future__ import annotations

import logging

from ..cluster.items import Geometry, assemble, check, fits, item_key, split
from ..cluster.pool import Pool, pool_for
from ..contract.blockfile import HEADER_SIZE, TAG_SIZE, BlockCipher, chunk_span
from ..contract.cluster import ClusterConfig
from ..contract.errors import FormatError, IntegrityError
from ..counters import Counters
from ..daemonlink import DaemonLink
from .hits import Ciphers

log = logging.getLogger(__name__)


class TierReads:
    """One volume's reads from, and fills of, the cluster tier."""

    def __init__(self, volume_key: bytes, key_id: bytes, chunk_size: int, link: DaemonLink,
                 counters: Counters, ciphers: Ciphers):
        self._volume_key = volume_key
        self._key_id = key_id
        self._chunk = chunk_size
        self._link = link
        self.counters = counters
        self._ciphers = ciphers
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
        wanted = geo.slices(first, end)
        names = [item_key(key, i) for i in wanted]
        got = pool.get_many({key: names}, self.counters)
        values = [got.get(n) for n in names]
        if any(v is None for v in values):
            self.counters.add("cluster_misses")
            return None
        try:
            parts = [check(geo, i, v) for i, v in zip(wanted, values)]
            head = parts[0][0]
            if any(h != head for h, _ in parts):
                raise FormatError("its slices belong to different copies of the block")
            cipher = self._cipher(key, head, blen)
            body = parts[0][1] if len(parts) == 1 else memoryview(b"".join(b for _, b in parts))
            skip = (first - wanted[0] * geo.per) * (chunk + TAG_SIZE)
            span = min(end * chunk, blen) - first * chunk + (end - first) * TAG_SIZE
            n = hi - lo
            target = memoryview(bytearray(n)) if out is None else out[:n]
            cipher.read_range_into(lo, body[skip:skip + span], target)
        except (FormatError, IntegrityError) as exc:
            self._bad(pool, key, geo, exc)
            return None
        self.counters.add2("cluster_hits", "cluster_bytes", sum(map(len, values)))
        return target.tobytes() if out is None else n

    def blocks(self, wanted: list[tuple[str, int]]) -> dict[str, bytes]:
        """The whole blocks found authentic in the tier, by key, from
        [(key, block length)]: each also handed sealed to the daemon."""
        pool = self.pool()
        wanted = [(k, blen) for k, blen in wanted if fits(k)]
        if pool is None or not wanted:
            return {}
        geos = {k: Geometry(blen, self._chunk) for k, blen in wanted}
        names = {k: [item_key(k, i) for i in range(geo.count)] for k, geo in geos.items()}
        got = pool.get_many(names, self.counters)
        found = {}
        for k, geo in geos.items():
            values = [got.get(n) for n in names[k]]
            if any(v is None for v in values):
                self.counters.add("cluster_misses")
                continue
            try:
                found[k] = self._open(k, geo, values)
            except (FormatError, IntegrityError) as exc:
                self._bad(pool, k, geo, exc)
                continue
            self.counters.add2("cluster_hits", "cluster_bytes", sum(map(len, values)))
        return found

    def _open(self, key: str, geo: Geometry, values: list[bytes]) -> bytes:
        """A block's plaintext from all its items, authenticated whole; its
        block file's bytes go to the daemon as they are."""
        head, blob = assemble(geo, values)
        cipher = self._cipher(key, head, geo.blen)
        plain = bytearray(geo.blen)
        cipher.read_range_into(0, memoryview(blob)[HEADER_SIZE:], memoryview(plain))
        if self._link.connected:
            self._link.offer_fill(key, blob, sealed=True)
        return bytes(plain)

    def _cipher(self, key: str, head: bytes, blen: int) -> BlockCipher:
        ck = (key, head)
        cipher = self._ciphers.get(ck)
        if cipher is None:
            cipher = BlockCipher.from_head(head, key, self._volume_key, self._key_id)
            if cipher.plaintext_len != blen or cipher.chunk_size != self._chunk:
                raise FormatError(f"item holds {cipher.plaintext_len} bytes in chunks of "
                                  f"{cipher.chunk_size}; this block has {blen} in chunks of "
                                  f"{self._chunk}")
            self._ciphers.keep(ck, cipher)
        return cipher

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
