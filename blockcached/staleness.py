"""The capacity policy's stale rule: finding cached blocks no longer read.

Frequency-gated admission keeps whatever was asked for most, so a working
set that stops being read (job A's dataset, once job B runs) would hold its
place on its old counts. Whether the cache's blocks are still read is judged
where the victims come from: the LRU head. At the end of each window (a
quarter of the entries' accesses, `Policy`'s) every dir's oldest half is
sampled (up to `SAMPLE` keys, evenly spread, in LRU order); at the next
window's end each sampled key is found hit, not hit, or evicted, and a dead
run is demoted: its blocks' counts drop to 0 (`Index.demote`), so any block
asked for before is admitted over them, while they keep their LRU places.
The demoted keys go to `on_demote`, which the cache uses to write their 0
into their mtimes, so a demotion survives a restart.

A run is dead when
- some sampled blocks were hit, at rate p, and the oldest `run` of them all
  were not: live blocks of shuffled epochs are hit in random order, so such
  a run has odds (1 - p) ** run, demoted below `DEAD_ODDS` (up to its last
  block: job A's leftovers ahead of job B's blocks); or
- none was hit, and either most sampled blocks had been hit while cached
  (count >= 2 at sampling: a working set that has stopped), or most of the
  window's misses were returning blocks (a working set that is coming back
  refused). Every block untouched during the window is demoted then. A cache
  filled by a dataset's first epoch (counts of 1, new blocks missing) is
  left alone: its blocks were never hit because nothing was read twice yet.

Only keys, counts and LRU order are read, never a hit per block: a touched
key moves to the end of its dir's dict, and at most `accesses` keys were
touched or added since the sample, so the first len - accesses keys are
exactly untouched ones, whatever happened behind them. A sampled key found
further back is counted hit, which errs towards keeping it (so does
counting the accesses of every dir against each). The sample is taken and
judged once per window: C-level passes over half the dir's keys, amortised
over the window's quarter of the entries' accesses; a demotion walks the
demoted keys once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from .index import COUNT_MASK, Index

SAMPLE = 512        # oldest blocks sampled per dir and window
DEAD_ODDS = 1e-4    # chance, for live blocks, of the unhit run; below it the run is dead
HIT_BEFORE = 2      # a count of 2 or more: asked for again while cached


@dataclass(slots=True)
class HeadSample:
    """A dir's oldest blocks at a window's end, oldest first."""
    keys: list[str]
    region: int       # they were among the first `region` keys (unhit, they still are)
    popular: int      # how many had a count >= HIT_BEFORE
    accesses: int     # the cache's accesses (hits, touches, puts) when taken


@dataclass(slots=True)
class Verdict:
    """One dir's judgement: sampled blocks hit and not, the oldest unhit run."""
    hit: int
    unhit: int
    run: int
    demoted: int


class StaleRule:
    """Samples each dir's LRU head per window and demotes dead runs."""

    def __init__(self, on_demote: Callable[[int, list[str]], None] | None = None) -> None:
        self._on_demote = on_demote  # (dir, keys) of each demotion
        self._samples: dict[int, HeadSample] = {}
        self.demoted = 0        # blocks demoted so far
        self.stale = False      # whether the last window demoted any

    def window_end(self, index: Index, accesses: int, misses: int, returning: int) -> None:
        """A window ended after `accesses` cache accesses; `misses` of this
        window went to admission, `returning` of them asked for before."""
        demoted = 0
        for i in range(len(index.dirs)):
            sample = self._samples.pop(i, None)
            if sample is not None:
                demoted += self.judge(index, i, sample, accesses, misses, returning).demoted
            self._samples[i] = self.sample(index, i, accesses)
        self.demoted += demoted
        self.stale = demoted > 0

    @staticmethod
    def sample(index: Index, i: int, accesses: int) -> HeadSample:
        lru = index.dirs[i].lru
        half = len(lru) // 2
        keys = list(itertools.islice(lru, 0, half, max(1, half // SAMPLE)))
        popular = sum((lru[k] & COUNT_MASK) >= HIT_BEFORE for k in keys)
        return HeadSample(keys, half, popular, accesses)

    def judge(self, index: Index, i: int, sample: HeadSample, accesses: int,
              misses: int, returning: int) -> Verdict:
        lru = index.dirs[i].lru
        # the first `untouched` keys were neither touched nor added since the sample
        untouched = len(lru) - (accesses - sample.accesses)
        if untouched <= 0 or not sample.keys:
            return Verdict(0, 0, 0, 0)
        still = set(sample.keys).intersection(
            itertools.islice(lru, min(untouched, sample.region)))
        hit = unhit = run = 0
        last = None
        for k in sample.keys:
            if k in still:
                unhit += 1
                if not hit:
                    run, last = run + 1, k
            elif k in lru:
                hit += 1
        if not run:
            return Verdict(hit, unhit, 0, 0)
        if hit:
            if (unhit / (hit + unhit)) ** run >= DEAD_ODDS:
                return Verdict(hit, unhit, run, 0)
            return Verdict(hit, unhit, run, self._demote(index, i, through=last))
        if 2 * sample.popular < len(sample.keys) and 2 * returning < misses:
            return Verdict(0, unhit, run, 0)
        return Verdict(0, unhit, run, self._demote(index, i, count=untouched))

    def _demote(self, index: Index, i: int, count: int | None = None,
                through: str | None = None) -> int:
        keys = index.demote(i, count, through)
        if keys and self._on_demote is not None:
            self._on_demote(i, keys)
        return len(keys)
