"""The mount process's garbage collector, set once the server is up: what was
made while mounting is frozen out of its reach, and the young generation is
collected less often (fsclient/DESIGN.md, "The garbage collector stays out of
the way")."""

from __future__ import annotations

import gc

# Container allocations between two young-generation collections (Python's
# default: 700, at which a warm small file's few lasting allocations made the
# loop collect every few hundred files, walking older generations now and
# then). Garbage cycles are rare here (reference counting frees each
# request's objects), so collecting less often costs little memory.
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """Collect once, move everything made while mounting (modules, the
    volume, config) out of the collector's reach for good (gc.freeze: it
    is never garbage, and every older-generation collection walked all of
    it), and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
