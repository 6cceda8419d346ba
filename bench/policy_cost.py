"""Micro-benchmark of the daemon's index operations under each capacity policy.

    python -m bench.policy_cost [--entries 200000] [--rounds 15] [--chunk 2000]

Times, on the cache engine itself (no socket, no disk: a dir worker's job
is not run, but its `done` is called at once as if the write had succeeded,
so a put costs what the event loop does for it, admission and indexing the
written block), per key:
- lookup: `Cache.lookup` of one cached key per call;
- touch: `Cache.touch` of one key per call, and of 64 keys per call;
- put (room): `Cache.put` of a new block into a dir with room;
- put (full): the same into a full dir (the policy picks victims or refuses);
and the index's memory per entry (tracemalloc, keys included).

Each policy the engine knows ("lru" = every block admitted, the LRU evicts,
with no admission policy; "tinylfu") has its own engines, all alive at
once; each round times one chunk of each op under each policy in turn (the
order alternating), in CPU time of this process. Printed: each policy's
median, and the median of the rounds' tinylfu/lru ratios judged against the
target (within 10%): pairs timed side by side, so a change of load
on a shared machine hits both sides of a ratio alike. Run it with PYTHONPATH
pointing at an older tree to measure that tree's engine (if it has no policy
setting, one column, "default").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable

from blockcached import config
from blockcached.cache import Cache

BLOCK = 1000
MAX_RATIO = 1.10          # the policy's cost per op against plain LRU's
MAX_BYTES_PER_ENTRY = 250


def block_key(i: int) -> str:
    """The i-th block key of the engine's synthetic index."""
    return f"imagenet_{1_000_000 + i // 16}_6869636e6f6c6f67_{(i % 16) << 20}"


def engine(tmp: str, entries: int, policy: str | None, full: bool) -> Cache:
    """The cache engine in-process with `entries` blocks indexed, room for more
    (or `full`: at its high watermark), its dir jobs done at once."""
    values: dict = {"min_free_bytes": 0, "min_free_inodes": 0}
    if policy is not None:
        values["admission_policy"] = policy
    size = int(entries * BLOCK / 0.98) if full else entries * BLOCK * 4
    cfg = config.build(values, {"cache_dirs": [config.CacheDirConfig(tmp, size)]})
    cache = Cache(cfg, asyncio.new_event_loop())
    cache.workers[0].submit = _done_at_once  # no disk work: the loop's share only
    cache.rebuilding[0] = False
    now = int(time.time())
    cache.index.add_many(0, ((now, block_key(i), BLOCK) for i in range(entries)))
    if cache_policy(cache) is not None:
        cache_policy(cache).fit(entries)
    return cache


def _done_at_once(fn, *args, done=None, **kwargs) -> None:
    """A dir worker's `submit` whose job succeeds at once without running."""
    if done is not None:
        done(None, None)


def cache_policy(cache: Cache):
    return getattr(cache, "policy", None)


def _per_key(fn, calls: int, keys_per_call: int = 1) -> float:
    gc.disable()
    t0 = time.process_time()  # CPU time: other processes on a shared machine do not count
    fn()
    dt = time.process_time() - t0
    gc.enable()
    return dt / (calls * keys_per_call) * 1e6


def _cpu_per_key(fn: Callable[[], object], keys: int) -> float:
    gc.disable()
    t0 = time.process_time()  # CPU time: other processes on a shared machine do not count
    fn()
    dt = time.process_time() - t0
    gc.enable()
    return dt / keys * 1e6


def chunk_ops(tmp: str, entries: int, policy: str | None,
              chunk: int) -> dict[str, Callable[[], float]]:
    """One policy's engines (a dir with room, a full one) and, per op, a
    function timing one chunk of it (us of CPU per key). Every policy puts
    the same new keys in the same order."""
    room = engine(tmp, entries, policy, full=False)
    full = engine(tmp, entries, policy, full=True)
    keys = [block_key(i) for i in range(0, entries, max(1, entries // chunk))][:chunk]
    batches = [keys[i:i + 64] for i in range(0, len(keys) - 63, 64)]
    blob = b"\0" * BLOCK
    fresh = itertools.count(entries)

    def puts(cache: Cache) -> float:
        new = [block_key(next(fresh)) for _ in range(chunk)]
        return _cpu_per_key(lambda: [cache.put(k, blob) for k in new], chunk)

    return {
        "lookup": lambda: _cpu_per_key(lambda: [room.lookup([k]) for k in keys], len(keys)),
        "touch": lambda: _cpu_per_key(lambda: [room.touch([k]) for k in keys], len(keys)),
        "touch x64": lambda: _cpu_per_key(lambda: [room.touch(b) for b in batches],
                                          64 * len(batches)),
        "put (room)": lambda: puts(room),
        "put (full)": lambda: puts(full),
    }


def index_bytes_per_entry(tmp: str, entries: int, policy: str | None) -> float:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = engine(tmp, entries, policy, full=False)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del cache
    return used / entries


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.policy_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--chunk", type=int, default=2000, help="keys per op and round")
    args = p.parse_args(argv)
    known = "admission_policy" in config.Config.__dataclass_fields__
    policies: list[str | None] = ["lru", "tinylfu"] if known else [None]
    tmp = tempfile.mkdtemp(prefix="bc-policy-cost-")
    try:
        ops = {pol: chunk_ops(tmp, args.entries, pol, args.chunk) for pol in policies}
        samples: dict = {pol: {op: [] for op in ops[pol]} for pol in policies}
        for r in range(args.rounds):
            for op in ops[policies[0]]:
                for pol in (policies if r % 2 == 0 else policies[::-1]):
                    samples[pol][op].append(ops[pol][op]())
        del ops
        mem = {pol: index_bytes_per_entry(tmp, args.entries, pol) for pol in policies}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    names = [pol or "default" for pol in policies]
    print(f"{args.entries} entries, {args.rounds} rounds of {args.chunk} keys, "
          f"median us of CPU per key; ratio: median of the rounds' ratios")
    print(f"{'op':<13}" + "".join(f"{n:>10}" for n in names)
          + (f"   tinylfu/lru (target <= {MAX_RATIO:.2f}x)" if known else ""))
    for op in samples[policies[0]]:
        meds = [statistics.median(samples[pol][op]) for pol in policies]
        verdict = ""
        if known:  # the median of each round's ratio: pairs measured side by side
            lru, tiny = (samples[pol][op] for pol in policies)
            ratio = statistics.median(t / o for o, t in zip(lru, tiny))
            verdict = f"   {ratio:.2f}x {'met' if ratio <= MAX_RATIO else 'NOT MET'}"
        print(f"{op:<13}" + "".join(f"{m:>10.3f}" for m in meds) + verdict)
    worst = max(mem.values())
    print(f"{'index B/entry':<13}" + "".join(f"{mem[pol]:>10.0f}" for pol in policies)
          + f"   target <= {MAX_BYTES_PER_ENTRY}: "
          + ("met" if worst <= MAX_BYTES_PER_ENTRY else "NOT MET"))


if __name__ == "__main__":
    main()
