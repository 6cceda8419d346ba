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
back into the sketch, an admitted one's comes out of it. Every `SAMPLE_FACTOR`
x entries misses the sketch is halved and `ages` grows, and the cache then
halves the cached blocks' counts too, so both sides fade alike. A pure
frequency gate never lets a new working set in while the old one still
looks popular, so the policy also watches the cache as a whole: when its
cached blocks have stopped being hit while blocks it refused keep coming
back (`STALE_RATIO` returning misses per hit, or none hit at all, over the
last two windows of a quarter of the entries' accesses), the cache is `stale`
and any block asked for before is admitted over the LRU.

What the policy knows of cached blocks survives a restart in the block
files' mtimes: the nanoseconds field carries the count (`encode_mtime_ns`),
written with the recency the daemon persists anyway.
"""

from __future__ import annotations

from collections.abc import Iterable

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
    """Approximate access counts of recently seen keys, in fixed memory."""

    __slots__ = ("table", "mask", "added", "sample", "ages")

    def __init__(self, slots: int = MIN_SLOTS):
        self.table = bytearray(slots)
        self.mask = slots - 1
        self.added = 0
        self.ages = 0
        self.sample = SAMPLE_FACTOR * slots // SLOTS_PER_ENTRY

    def estimate(self, key: str) -> int:
        h = hash(key)
        t, m = self.table, self.mask
        a, b = t[h & m], t[(h >> 32) & m]
        return a if a < b else b

    def add(self, key: str) -> int:
        """Count one access of `key`; returns its estimate before it."""
        h = hash(key)
        t, m = self.table, self.mask
        i, j = h & m, (h >> 32) & m
        a, b = t[i], t[j]
        before = a if a < b else b
        if before < MAX_COUNT:
            # conservative update: raise only the slots at the minimum
            if a == before:
                t[i] = a + 1
            if b == before:
                t[j] = b + 1
        self.added += 1
        if self.added >= self.sample:
            self.age()
        return before

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
        self.table = bytearray(self.table.translate(_HALVE))
        self.added = 0
        self.ages += 1

    def fit(self, entries: int) -> None:
        """Grow the table for `entries` cached blocks; counts are kept (each
        key's new slot is a copy of its old one)."""
        while len(self.table) < SLOTS_PER_ENTRY * entries:
            self.table = self.table * 2
            self.mask = len(self.table) - 1
            self.sample = SAMPLE_FACTOR * len(self.table) // SLOTS_PER_ENTRY


class Policy:
    """Admission decisions and the counters that explain them."""

    name = NAME

    def __init__(self) -> None:
        self.sketch = FrequencySketch()
        # stale detection: this window's start (hits, misses) and its returning
        # misses; the last window's (hits, returning misses)
        self._window_hits = self._window_misses = self._misses = self._returning = 0
        self._last = (0, 0)
        self.window_size = MIN_WINDOW
        self.stale = False
        self.admitted: dict[str, int] = {}   # reason -> count
        self.admitted_room = 0  # admitted with room to spare (counted apart: the common put)
        self.rejected: dict[str, int] = {}

    # -- what readers do ---------------------------------------------------

    def miss(self, key: str, hits_total: int) -> int:
        """A block was offered after a miss, the cache having answered
        `hits_total` hits so far (its own counter: nothing is done per hit
        here); returns how often the block was asked for before (the
        candidate's frequency for `admit`)."""
        before = self.sketch.add(key)
        self._misses += 1
        hits = hits_total - self._window_hits
        if before:
            self._returning += 1
            last_hits, last_returning = self._last
            # cached blocks no longer hit while refused ones come back: over
            # this window and the last, far more returning misses than hits
            self.stale = (self._returning + last_returning
                          >= STALE_RATIO * (hits + last_hits))
        if hits + self._misses - self._window_misses >= self.window_size:
            self._last = (hits, self._returning)
            self._window_hits, self._window_misses, self._returning = hits_total, self._misses, 0
        return before

    def fit(self, entries: int) -> None:
        """Size the sketch and the stale window for `entries` cached blocks."""
        self.sketch.fit(entries)
        self.window_size = max(MIN_WINDOW, entries // 4)

    # -- decisions ---------------------------------------------------------

    def admit(self, before: int, victim_counts: Iterable[int]) -> str | None:
        """Whether a block asked for `before` times before may displace the
        blocks with `victim_counts` (those that would leave for it): the
        reason it is admitted, or None."""
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
        if self.admitted_room:
            admitted["room"] = admitted.get("room", 0) + self.admitted_room
        return {"name": self.name, "stale": self.stale, "admitted": admitted,
                "rejected": dict(self.rejected)}


def encode_mtime_ns(seconds: int, count: int) -> int:
    return seconds * 1_000_000_000 + MTIME_MARK + min(max(count, 0), MAX_COUNT)


def decode_mtime_ns(ns: int) -> tuple[int, int]:
    """(seconds, frequency) of a mtime in ns; frequency 0 if none was written."""
    seconds, frac = divmod(ns, 1_000_000_000)
    count = frac - MTIME_MARK
    return seconds, count if 0 <= count <= MAX_COUNT else 0
