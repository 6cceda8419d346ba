"""Micro-benchmark of the daemon's index operations under each capacity policy.

    python -m bench.policy_cost [--entries 200000] [--rounds 7]

Times, on the cache engine itself (no socket, no disk: the dir workers'
jobs are collected, not run), per key:
- lookup: `Cache.lookup` of one cached key per call;
- touch: `Cache.touch` of one key per call, and of 64 keys per call;
- put (room): `Cache.put` of a new block into a dir with room;
- put (full): the same into a full dir (the policy picks victims or refuses);
and the index's memory per entry (tracemalloc, keys included).

Each policy the engine knows ("lru" = every block admitted, the LRU evicts,
as before the capacity policy; "tinylfu") is measured in alternating rounds,
in CPU time of this process, and the fastest round kept (the least disturbed
by other work on the machine). Run it with PYTHONPATH pointing at an older tree to
measure that tree's engine (it then has one policy, "default").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import tempfile
import time
import tracemalloc

from blockcached import config
from blockcached.cache import Cache

BLOCK = 1000


def _key(i: int) -> str:
    return f"imagenet_{1_000_000 + i // 16}_6869636e6f6c6f67_{(i % 16) << 20}"


def _engine(tmp: str, entries: int, policy: str | None, full: bool) -> Cache:
    values: dict = {"min_free_bytes": 0, "min_free_inodes": 0}
    if policy is not None:
        values["admission_policy"] = policy
    size = int(entries * BLOCK / 0.98) if full else entries * BLOCK * 4
    cfg = config.build(values, {"cache_dirs": [config.CacheDirConfig(tmp, size)]})
    cache = Cache(cfg, asyncio.new_event_loop())
    cache.workers[0].submit = lambda *a, **k: None  # no disk work: the loop's share only
    cache.rebuilding[0] = False
    now = int(time.time())
    cache.index.add_many(0, ((now, _key(i), BLOCK) for i in range(entries)))
    if cache_policy(cache) is not None:
        cache_policy(cache).fit(entries)
    return cache


def cache_policy(cache: Cache):
    return getattr(cache, "policy", None)


def _per_key(fn, calls: int, keys_per_call: int = 1) -> float:
    gc.disable()
    t0 = time.process_time()  # CPU time: other processes on a shared machine do not count
    fn()
    dt = time.process_time() - t0
    gc.enable()
    return dt / (calls * keys_per_call) * 1e6


def measure(tmp: str, entries: int, policy: str | None) -> dict[str, float]:
    out = {}
    cache = _engine(tmp, entries, policy, full=False)
    keys = [_key(i) for i in range(0, entries, max(1, entries // 20000))]
    out["lookup"] = _per_key(lambda: [cache.lookup([k]) for k in keys], len(keys))
    out["touch"] = _per_key(lambda: [cache.touch([k]) for k in keys], len(keys))
    batches = [keys[i:i + 64] for i in range(0, len(keys) - 63, 64)]
    out["touch x64"] = _per_key(lambda: [cache.touch(b) for b in batches], len(batches), 64)
    blob = b"\0" * BLOCK
    fresh = [_key(entries + i) for i in range(5000)]
    out["put (room)"] = _per_key(lambda: [cache.put(k, blob) for k in fresh], len(fresh))
    cache = _engine(tmp, entries, policy, full=True)
    fresh = [_key(2 * entries + i) for i in range(5000)]
    out["put (full)"] = _per_key(lambda: [cache.put(k, blob) for k in fresh], len(fresh))
    return out


def index_bytes_per_entry(tmp: str, entries: int, policy: str | None) -> float:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = _engine(tmp, entries, policy, full=False)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del cache
    return used / entries


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.policy_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    known = "admission_policy" in config.Config.__dataclass_fields__
    policies: list[str | None] = ["lru", "tinylfu"] if known else [None]
    tmp = tempfile.mkdtemp(prefix="bc-policy-cost-")
    try:
        samples: dict = {pol: {} for pol in policies}
        for _ in range(args.rounds):
            for pol in policies:
                for op, us in measure(tmp, args.entries, pol).items():
                    samples[pol].setdefault(op, []).append(us)
        mem = {pol: index_bytes_per_entry(tmp, args.entries, pol) for pol in policies}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    names = [pol or "default" for pol in policies]
    print(f"{args.entries} entries, fastest of {args.rounds} rounds, us of CPU per key")
    print(f"{'op':<12}" + "".join(f"{n:>10}" for n in names) + ("   tinylfu/lru" if known else ""))
    for op in samples[policies[0]]:
        meds = [min(samples[pol][op]) for pol in policies]
        ratio = f"   {meds[1] / meds[0]:.2f}x" if known else ""
        print(f"{op:<12}" + "".join(f"{m:>10.3f}" for m in meds) + ratio)
    print(f"{'index B/entry':<12}" + "".join(f"{mem[pol]:>10.0f}" for pol in policies))


if __name__ == "__main__":
    main()
