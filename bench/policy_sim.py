"""The capacity scenarios on the cache engine in-process, at realistic scale.

    python -m bench.policy_sim [--blocks 800,32768,200000] [--scenarios ...]

`bench capacity`'s scenarios (bench/capacity.py), each on a real `Cache`
(blockcached/cache.py: the real `Policy`, `Index`, capacity and quota code)
with no daemon, socket or disk: a dir worker's job is not run, its `done` is
called at once as if the write had succeeded, so a put is admitted, evicts
and is indexed as in the daemon, in microseconds. That lets each scenario run
at the scales where the policy's sketch collides as it does on a real host
(32 to 64 slots per cached block, `SLOTS_PER_ENTRY` and doubling, from
2,048 blocks up): the daemon run stays small (800 blocks, ~80 slots per
entry: the sketch's smallest table). The engine's upkeep (`Cache.tick`: the
aging of cached counts, a chunk at a time) runs every `TICK_ACCESSES`
accesses, about what a busy daemon serves between two ticks.

Printed: one row per scenario phase, one hit-ratio column per scale, and
whether every scale meets the phase's target.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from blockcached import config
from blockcached.cache import Cache

from . import capacity
from .capacity import CacheReader, Result, Scale

SCALES = (800, 32_768, 200_000)
BENCH_SCALE = 32_768   # the scale `python -m bench capacity` adds to its daemon run
HEADING = ("in-process engine (real Policy, Index, quotas; no daemon, socket or disk), "
           "hit ratio per cache size in blocks")
BLOCK_BYTES = 1000     # plaintext; nothing is sealed or written, only sizes count
TICK_ACCESSES = 1000   # accesses between two upkeep rounds (a daemon ticks every 0.25 s)
SCENARIOS = {
    "shuffled": lambda s, c: (capacity.shuffled_epochs(s, 1.5, cache=c)
                              + capacity.shuffled_epochs(s, 3, cache=c)),
    "fits": lambda s, c: capacity.shuffled_epochs(s, 0.9, epochs=3, cache=c),
    "switch": capacity.working_set_change,
    "sweep": capacity.hot_and_cold_sweep,
    "quotas": capacity.quotas,
}


class EngineReader:
    """A reader on an in-process `Cache`: lookup, and on a miss put a block
    of the file size a daemon would store."""

    def __init__(self, cache: Cache, file_bytes: int):
        self.cache = cache
        self.blob = b"\0" * file_bytes
        self._to_tick = TICK_ACCESSES

    def epoch(self, keys: list[str]) -> float:
        lookup, put, blob = self.cache.lookup, self.cache.put, self.blob
        hits = 0
        for k in keys:
            if lookup([k])[0] is not None:
                hits += 1
            else:
                put(k, blob)
            self._to_tick -= 1
            if not self._to_tick:
                self._to_tick = TICK_ACCESSES
                self.cache.age_counts()
        return hits / len(keys) if keys else 0.0

    def stats(self) -> dict:
        return self.cache.stats()


def _done_at_once(fn, *args, done=None, **kwargs) -> None:
    """A dir worker's `submit` whose job succeeds at once without running."""
    if done is not None:
        done(None, None)


@contextmanager
def in_process(scale: Scale, quotas: dict[str, int]) -> Iterator[CacheReader]:
    """A `capacity.OpenCache`: the engine with one dir of `scale.blocks`
    blocks, its workers replaced by `_done_at_once`."""
    tmp = tempfile.mkdtemp(prefix="bc-policy-sim-")
    loop = asyncio.new_event_loop()
    try:
        size = scale.blocks * capacity.file_bytes(scale)
        cfg = config.build({"min_free_bytes": 0, "min_free_inodes": 0,
                            "volume_quotas": tuple(quotas.items())},
                           {"cache_dirs": [config.CacheDirConfig(tmp, size)]})
        cache = Cache(cfg, loop)
        for w in cache.workers:
            w.submit = _done_at_once
        cache.rebuilding = [False] * len(cache.rebuilding)
        yield EngineReader(cache, capacity.file_bytes(scale))
    finally:
        loop.close()
        shutil.rmtree(tmp, ignore_errors=True)


def run(blocks: int, scenarios: list[str]) -> list[Result]:
    scale = Scale(blocks, BLOCK_BYTES)
    return [r for name in scenarios for r in SCENARIOS[name](scale, in_process)]


def table(by_scale: dict[int, list[Result]]) -> str:
    """Scenario x phase rows, a hit-ratio column per scale, the target."""
    scales = list(by_scale)
    first = by_scale[scales[0]]
    head = (f"{'SCENARIO':<22} {'PHASE':<26}" + "".join(f"{n:>9}" for n in scales)
            + f" {'TARGET':>8}  MET")
    lines = [head]
    for i, r in enumerate(first):
        row = [by_scale[n][i] for n in scales]
        want = "-" if r.want <= 0 else f"{r.want:.3f}"
        if r.want <= 0:
            met = ""
        else:  # the target may depend on the scale (usable capacity / dataset)
            met = "yes" if all(x.met for x in row) else "NO"
        lines.append(f"{r.scenario:<22} {r.phase:<26}"
                     + "".join(f"{x.hit_ratio:>9.3f}" for x in row) + f" {want:>8}  {met}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.policy_sim",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default=",".join(map(str, SCALES)),
                   help="cache sizes in blocks, comma-separated (default: %(default)s)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma-separated, of: %(default)s")
    args = p.parse_args(argv)
    try:
        scales = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        p.error(f"--blocks {args.blocks!r}: give cache sizes in blocks, e.g. 800,32768")
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"--scenarios: unknown {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    by_scale = {}
    for n in scales:
        t0 = time.monotonic()
        by_scale[n] = run(n, names)
        print(f"{n} blocks: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    text = table(by_scale)
    print(HEADING)
    print(text)
    return 0 if all(r.met for rs in by_scale.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
