"""The capacity policy: which block a full dir keeps, frequency-gated admission.

TinyLFU (Einziger, Friedman, Manes 2017) in front of the index's LRU order:
a block offered to a full dir is admitted only if it has been asked for more
often, recently, than every block that would have to leave for it; ties go to
the block already cached. Under shuffled epochs over a dataset larger than the
cache every block is asked for once per epoch, so the cache keeps one fixed
subset (the best a cache without prefetch can do) instead of LRU's evicting
each block shortly before its turn comes; a one-off sweep of cold blocks
never displaces a hot set. DESIGN.md ("Capacity policy") argues the choice.

A cached block's frequency is its access count in the index (`Index.touch`
counts it in bits the entry already has: nothing per hit here). Blocks not
cached are counted in a `FrequencySketch` (a byte per slot, two slots per
key, the estimate is the smaller) on each miss; an evicted block's count goes
back into the sketch, an admitted one takes the count its miss found into
the index. Every `SAMPLE_FACTOR` x entries misses the sketch is halved and
`ages` grows, and the cache then halves the cached blocks' counts too, so
both sides fade alike. A pure
frequency gate never lets a new working set in while the old one still
looks popular, so the policy also watches the cache as a whole: when its
cached blocks have stopped being hit while blocks it refused keep coming
back (`STALE_RATIO` returning misses per hit, or none hit at all, over the
last two windows of a quarter of the entries' accesses, each sized when it
starts), the cache is `stale` and any block asked for before is admitted
over the LRU. A put pays for all this with one call, `miss(key)` (issue #21:
a put's cost stays near plain LRU's): nothing runs per hit or per write, and
the cache's hit counters are read only when a miss needs them.

What the policy knows of cached blocks survives a restart in the block
files' mtimes: the nanoseconds field carries the count (`encode_mtime_ns`),
written with the recency the daemon persists anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sized

from .index import COUNT_MASK

NAME = "tinylfu"  # frequency-gated admission in front of LRU
MAX_COUNT = COUNT_MASK  # counts saturate here, in the sketch as in the index
SAMPLE_FACTOR = 10     # halve all counts every SAMPLE_FACTOR x slots/8 increments
MIN_SLOTS = 1 << 16
SLOTS_PER_ENTRY = 8    # table slots (bytes) per cached block: few collisions
STALE_RATIO = 16       # returning misses per hit at which the cache counts as stale
MIN_WINDOW = 64        # accesses per stale-detection window, at least
# A mtime whose nanoseconds are MTIME_MARK + f carries frequency f; any
# other value (a block just written, a file system without ns times) reads 0.
MTIME_MARK = 314_159_000
_HALVE = bytes(i >> 1 for i in range(256))


class FrequencySketch:
    """Approximate access counts of recently seen keys, in fixed memory. The
    increment is `Policy.miss`'s, inline: it runs once per put."""

    __slots__ = ("table", "mask", "sample", "ages")

    def __init__(self, slots: int = MIN_SLOTS):
        self.table = bytearray(slots)
        self.mask = slots - 1
        self.ages = 0
        self.sample = SAMPLE_FACTOR * slots // SLOTS_PER_ENTRY  # increments between halvings

    def estimate(self, key: str) -> int:
        h = hash(key)
        t, m = self.table, self.mask
        a, b = t[h & m], t[(h >> 32) & m]
        return a if a < b else b

    def raise_to(self, key: str, count: int) -> None:
        """Make `key`'s estimate at least `count` (restoring a restart's state)."""
        h = hash(key)
        t, m = self.table, self.mask
        count = min(count, MAX_COUNT)
        for i in (h & m, (h >> 32) & m):
            if t[i] < count:
                t[i] = count

    def age(self) -> None:
        """Halve every count (TinyLFU's reset), so popularity fades."""
        self.table[:] = self.table.translate(_HALVE)  # in place: `Policy` holds the table
        self.ages += 1

    def fit(self, entries: int) -> None:
        """Grow the table for `entries` cached blocks; counts are kept (each
        key's new slot is a copy of its old one)."""
        while len(self.table) < SLOTS_PER_ENTRY * entries:
            self.table += bytes(self.table)
            self.mask = len(self.table) - 1
            self.sample = SAMPLE_FACTOR * len(self.table) // SLOTS_PER_ENTRY


class Policy:
    """Admission decisions and the counters that explain them. `cached` is
    the cache's index (its len() is the cached blocks), read once a window;
    `counters` the cache's, whose "hits" + "touches" are the hits so far,
    read only when a miss needs them (not passed in by every put)."""

    name = NAME

    def __init__(self, cached: Sized = (), counters: Mapping[str, int] | None = None) -> None:
        self.sketch = FrequencySketch()
        # the sketch's table (grown and halved in place) and mask, for `miss`
        self._table, self._mask = self.sketch.table, self.sketch.mask
        self._cached = cached
        self._counters = counters if counters is not None else {"hits": 0, "touches": 0}
        self._misses = 0
        self._aged_at = 0  # misses at the sketch's last halving
        self._age_at = self.sketch.sample
        # stale detection: this window's start (hits, misses), where it ends
        # (hits + misses) and its returning misses; the last window's (hits, returning)
        self._window_hits = self._window_misses = self._returning = 0
        self._window_end = MIN_WINDOW
        # misses at which `_upkeep` next looks whether a halving or the
        # window's end is due: one test per miss, no hits read. It looks at
        # least every MIN_WINDOW misses, so a window ends at most that many
        # misses late (hits arriving meanwhile end it sooner than misses alone).
        self._next_upkeep = MIN_WINDOW
        self._last = (0, 0)
        self.stale = False
        self.admitted: dict[str, int] = {}   # reason -> count
        self.rejected: dict[str, int] = {}
        self._decided = 0  # misses `admit` decided; the others had room to spare

    # -- what readers do ---------------------------------------------------

    def miss(self, key: str) -> int:
        """A block was offered after a miss; returns how often it was asked
        for before (the candidate's frequency for `admit`). Runs at every put
        that reaches admission, so the sketch's increment is inline here, and
        the cache's hits are read only for a returning block or an upkeep."""
        h = hash(key)
        t, m = self._table, self._mask
        i, j = h & m, (h >> 32) & m
        a, b = t[i], t[j]
        # conservative update: raise only the slots at the minimum
        if a == b:  # the common case (a key never seen: both 0)
            before = a
            if a < MAX_COUNT:
                t[i] = t[j] = a + 1
        elif a < b:
            before = a
            t[i] = a + 1
        else:
            before = b
            t[j] = b + 1
        misses = self._misses = self._misses + 1
        if before:
            self._returning += 1
            c = self._counters  # inline: most misses into a full dir return
            hits = c["hits"] + c["touches"] - self._window_hits
            last_hits, last_returning = self._last
            # cached blocks no longer hit while refused ones come back: over
            # this window and the last, far more returning misses than hits
            self.stale = (self._returning + last_returning
                          >= STALE_RATIO * (hits + last_hits))
        if misses >= self._next_upkeep:
            self._upkeep()
        return before

    def _hits(self) -> int:
        c = self._counters
        return c["hits"] + c["touches"]

    def _upkeep(self) -> None:
        """The sketch's halving and the window's end, when one is due."""
        hits_total = self._hits()
        misses = self._misses
        if misses >= self._age_at:
            self.sketch.age()
            self._aged_at = misses
            self._age_at = misses + self.sketch.sample
        if hits_total + misses >= self._window_end:
            self._last = (hits_total - self._window_hits, self._returning)
            self._window_hits, self._window_misses, self._returning = hits_total, misses, 0
            self.fit(len(self._cached))
        else:
            self._schedule_upkeep(hits_total)

    def _schedule_upkeep(self, hits_total: int) -> None:
        """The next upkeep: at the halving, at the window's end if no hit
        comes meanwhile, or within MIN_WINDOW misses (hits may end it sooner)."""
        misses = self._misses
        self._next_upkeep = misses + max(1, min(self._age_at - misses, MIN_WINDOW,
                                                self._window_end - hits_total - misses))

    def fit(self, entries: int) -> None:
        """Size the sketch, and the stale window from its start, for
        `entries` cached blocks (at each window's start and after a rebuild:
        not per put, whose cost it would add to)."""
        self.sketch.fit(entries)
        self._mask = self.sketch.mask
        self._age_at = self._aged_at + self.sketch.sample
        self._window_end = (self._window_hits + self._window_misses
                            + max(MIN_WINDOW, entries // 4))
        self._schedule_upkeep(self._hits())

    # -- decisions ---------------------------------------------------------

    def admit(self, before: int, victim_counts: Iterable[int]) -> str | None:
        """Whether a block asked for `before` times before may displace the
        blocks with `victim_counts` (those that would leave for it): the
        reason it is admitted, or None."""
        self._decided += 1
        coldest = max(victim_counts, default=-1)
        if coldest < 0:
            return self._count(self.admitted, "room")
        if before > coldest:
            return self._count(self.admitted, "more_frequent")
        if self.stale and before > 0:
            return self._count(self.admitted, "stale_cache")
        self.rejected["less_frequent"] = self.rejected.get("less_frequent", 0) + 1
        return None

    @staticmethod
    def _count(counts: dict[str, int], reason: str) -> str:
        counts[reason] = counts.get(reason, 0) + 1
        return reason

    def evicted(self, key: str, count: int) -> None:
        """An evicted block remembers its count, should it come back."""
        self.sketch.raise_to(key, count)

    @property
    def ages(self) -> int:
        return self.sketch.ages

    def stats(self) -> dict:
        admitted = dict(self.admitted)
        # each miss is decided by `admit` unless its dir had room to spare:
        # those are counted here, not per put (0 if `admit` ran on its own)
        room = self._misses - self._decided
        if room > 0:
            admitted["room"] = admitted.get("room", 0) + room
        return {"name": self.name, "stale": self.stale, "admitted": admitted,
                "rejected": dict(self.rejected)}


def encode_mtime_ns(seconds: int, count: int) -> int:
    return seconds * 1_000_000_000 + MTIME_MARK + min(max(count, 0), MAX_COUNT)


def decode_mtime_ns(ns: int) -> tuple[int, int]:
    """(seconds, frequency) of a mtime in ns; frequency 0 if none was written."""
    seconds, frac = divmod(ns, 1_000_000_000)
    count = frac - MTIME_MARK
    return seconds, count if 0 <= count <= MAX_COUNT else 0
