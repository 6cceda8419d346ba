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
key in one 64-byte line, the estimate is the smaller) on each miss into a
full dir; an evicted block's count goes back into the sketch, an admitted
one takes the count its miss found into the index. Every `SAMPLE_FACTOR` x
entries such misses the
sketch is halved and `ages` grows, and the cache then halves the cached
blocks' counts too, so both sides fade alike. A pure frequency gate never
lets a new working set in while the old one still looks popular, so at the
end of each window (a quarter of the entries' accesses) the stale rule
(`staleness`) looks whether the oldest cached blocks are still hit, and
demotes those that are not to a count of 0. A put into a full dir pays for
all this with one call, `miss(key)`, a put into a dir with room with none
(so a put costs about what it costs under plain LRU): nothing runs per hit or
per write, and the cache's counters are read only at an upkeep.

What the policy knows of cached blocks survives a restart in the block
files' mtimes: the nanoseconds field carries the count (`encode_mtime_ns`),
written with the recency the daemon persists anyway, and a demotion's 0 is
written too. A block file whose mtime carries no count (just written) is
restored with a count of 1: it was put.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from .index import COUNT_MASK, Index
from .staleness import StaleRule

NAME = "tinylfu"  # frequency-gated admission in front of LRU
MAX_COUNT = COUNT_MASK  # counts saturate here, in the sketch as in the index
SAMPLE_FACTOR = 10     # halve all counts every SAMPLE_FACTOR x slots/8 increments
MIN_SLOTS = 1 << 16
# A key's two slots share one 64-byte line of the table (the first picks the
# line): one cache miss per sketch access, not two, on a table of megabytes.
LINE = 63
LINE_OFF = ~LINE
SLOTS_PER_ENTRY = 32   # table slots (bytes) per cached block: few collisions
MIN_WINDOW = 16        # accesses per stale-rule window, at least
UPKEEP_SPLIT = 8       # an upkeep at least every window / UPKEEP_SPLIT misses
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
        t, line = self.table, self.mask & LINE_OFF
        a, b = t[h & self.mask], t[(h & line) | (h >> 32) & LINE]
        return a if a < b else b

    def raise_to(self, key: str, count: int) -> None:
        """Make `key`'s estimate at least `count` (an evicted block's)."""
        h = hash(key)
        t, line = self.table, self.mask & LINE_OFF
        count = min(count, MAX_COUNT)
        for i in (h & self.mask, (h & line) | (h >> 32) & LINE):
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
    """Admission decisions and the counters that explain them. `index` is
    the cache's (its len() sizes the sketch and the windows, its dirs' LRU
    heads are what the stale rule samples); `counters` the cache's, whose
    "hits" + "touches" + "puts" are its accesses so far, read only at an
    upkeep (not passed in by every put); `on_demote` gets the (dir, keys)
    of each demotion by the stale rule."""

    name = NAME

    def __init__(self, index: Index | None = None,
                 counters: Mapping[str, int] | None = None,
                 on_demote: Callable[[int, list[str]], None] | None = None) -> None:
        self.sketch = FrequencySketch()
        # the sketch's table (grown and halved in place) and masks, for `miss`
        self._table, self._mask = self.sketch.table, self.sketch.mask
        self._line = self._mask & LINE_OFF
        self._index = index if index is not None else Index(1)
        self._counters = counters if counters is not None else {"hits": 0, "touches": 0,
                                                                 "puts": 0}
        self.stale_rule = StaleRule(on_demote)
        self._misses = 0   # misses into a full dir (`miss`): they age the sketch
        self._aged_at = 0  # misses at the sketch's last halving
        self._age_at = self.sketch.sample
        # this window: where it starts and ends (in accesses), its misses and
        # returning misses so far (misses counted at its start)
        self._window_start, self._window_end = 0, MIN_WINDOW
        self._window_misses = self._returning = 0
        # misses at which `_upkeep` next looks whether a halving or the
        # window's end is due: one test per miss, no counters read. It looks
        # at least every window / UPKEEP_SPLIT misses, so hits arriving
        # meanwhile end a window at most that many misses late.
        self._next_upkeep = MIN_WINDOW
        self.admitted: dict[str, int] = {}   # reason -> count
        self.rejected: dict[str, int] = {}

    # -- what readers do ---------------------------------------------------

    def miss(self, key: str) -> int:
        """A block was offered to a full dir after a miss; returns how often
        it was asked for before (the candidate's frequency for `admit`). Runs
        at every put that needs room, so the sketch's increment is inline."""
        h = hash(key)
        t = self._table
        i, j = h & self._mask, (h & self._line) | (h >> 32) & LINE
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
        if before:
            self._returning += 1
        misses = self._misses = self._misses + 1
        if misses >= self._next_upkeep:
            self._upkeep()
        return before

    def _accesses(self) -> int:
        c = self._counters
        return c["hits"] + c["touches"] + c["puts"]

    def _upkeep(self) -> None:
        """The sketch's halving and the window's end, when one is due."""
        accesses = self._accesses()
        misses = self._misses
        if misses >= self._age_at:
            self.sketch.age()
            self._aged_at = misses
            self._age_at = misses + self.sketch.sample
        if accesses >= self._window_end:
            self.stale_rule.window_end(self._index, accesses, misses - self._window_misses,
                                       self._returning)
            self._window_misses, self._returning = misses, 0
            self._window_start = accesses
            self.fit(len(self._index))
        else:
            self._schedule_upkeep(accesses)

    def _schedule_upkeep(self, accesses: int) -> None:
        """The next upkeep: at the halving, at the window's end if no hit
        comes meanwhile, or within a slice of the window (hits may end it sooner)."""
        misses = self._misses
        window = max(MIN_WINDOW, len(self._index) // 4)
        self._next_upkeep = misses + max(1, min(self._age_at - misses, window // UPKEEP_SPLIT,
                                                self._window_end - accesses))

    def fit(self, entries: int) -> None:
        """Size the sketch, and the window from its start, for `entries`
        cached blocks (at each window's start and after a rebuild: not per
        put, whose cost it would add to)."""
        self.sketch.fit(entries)
        self._mask = self.sketch.mask
        self._line = self._mask & LINE_OFF
        self._age_at = self._aged_at + self.sketch.sample
        self._window_end = self._window_start + max(MIN_WINDOW, entries // 4)
        self._schedule_upkeep(self._accesses())

    # -- decisions ---------------------------------------------------------

    def admit(self, before: int, victim_counts: Iterable[int]) -> str | None:
        """Whether a block asked for `before` times before may displace the
        blocks with `victim_counts` (those that would leave for it): the
        reason it is admitted, or None. Ties stay with the cached blocks."""
        if before > max(victim_counts, default=-1):
            self.admitted["more_frequent"] = self.admitted.get("more_frequent", 0) + 1
            return "more_frequent"
        self.rejected["less_frequent"] = self.rejected.get("less_frequent", 0) + 1
        return None

    def evicted(self, key: str, count: int) -> None:
        """An evicted block remembers its count, should it come back."""
        self.sketch.raise_to(key, count)

    @property
    def ages(self) -> int:
        return self.sketch.ages

    @property
    def stale(self) -> bool:
        return self.stale_rule.stale

    def stats(self, queued: int = 0) -> dict:
        """`queued`: the cache's puts queued so far; those the policy did not
        decide had room to spare (counted here, not per put)."""
        admitted = dict(self.admitted)
        room = queued - admitted.get("more_frequent", 0)
        if room > 0:
            admitted["room"] = room
        return {"name": self.name, "stale": self.stale, "demoted": self.stale_rule.demoted,
                "admitted": admitted, "rejected": dict(self.rejected)}


def encode_mtime_ns(seconds: int, count: int) -> int:
    return seconds * 1_000_000_000 + MTIME_MARK + min(max(count, 0), MAX_COUNT)


def decode_mtime_ns(ns: int) -> tuple[int, int | None]:
    """(seconds, frequency) of a mtime in ns; frequency None if none was written."""
    seconds, frac = divmod(ns, 1_000_000_000)
    count = frac - MTIME_MARK
    return seconds, count if 0 <= count <= MAX_COUNT else None
