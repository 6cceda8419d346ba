"""Workload `capacity`: the daemon's hit ratio when the data outgrows the cache.

    python -m bench capacity [--size tiny|small|default|large]

Each scenario starts a real `blockcached` with one cache dir of `blocks`
blocks and drives it as fsclient and `Volume` readers do: look a block up,
and on a miss seal it and put it (reads of a hit's file are the reader's, not
the daemon's, and are left out: the hit ratio is the daemon's policy alone).
Every hit ratio is printed beside its optimum, the best a cache without
prefetch can do (keeping a fixed subset: usable capacity / dataset):

1. shuffled epochs over datasets 1.5x and 3x the cache: warm epochs (2 on)
   >= 0.9x of the optimum;
2. a dataset that fits (0.9x): warm epochs >= 0.99;
3. the working set changes: job A (1.5x, 3 epochs), then job B (0.8x,
   fits): B's third epoch >= 0.95;
4. a hot set (0.5x) read throughout one pass over a cold set 3x the cache
   (a validation sweep): the hot set's hit ratio during and after >= 0.9;
5. two volumes with quotas of half the cache each; `big` reads 3x its
   share while `small` (0.4x of the cache) is read alongside: `small`'s
   warm hit ratio equals what it gets alone.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from blockcache_client.contract import blockfile
from blockcache_client.contract.blockkey import BlockKey
from devtools.daemon import DaemonProcess

VOLUME_KEY = bytes(range(32))
HIGH_WATERMARK = 0.98  # the daemon's default: a full dir is kept this full


@dataclass(frozen=True)
class Scale:
    """Cache size in blocks, and block size (plaintext bytes)."""
    blocks: int
    block_bytes: int


SCALES = {"tiny": Scale(100, 1000), "small": Scale(300, 4096), "default": Scale(800, 16384),
          "large": Scale(3000, 65536)}


def key(vol: str, i: int) -> str:
    return str(BlockKey(vol, i + 1, 0x5eed, 0))


class CacheReader(Protocol):
    """A reader on one cache: a daemon (`Reader`) or the engine in-process
    (`bench.policy_sim`)."""

    def epoch(self, keys: list[str]) -> float:
        """Read `keys` in order (look up; put on a miss); the hit ratio."""

    def stats(self) -> dict:
        """The cache's stats, as the daemon's `stats` op answers them."""


# A cache of `scale` with quotas {volume: max_bytes}, open for the scenario.
OpenCache = Callable[[Scale, dict[str, int]], AbstractContextManager[CacheReader]]


class Reader:
    """A reader on one daemon: lookup, and on a miss put the sealed block."""

    def __init__(self, daemon: DaemonProcess, block_bytes: int):
        self.client = daemon.client()
        self.daemon = daemon
        self.payload = b"\xa5" * block_bytes
        self._sealed: dict[str, bytes] = {}

    def epoch(self, keys: list[str]) -> float:
        """Read `keys` in order; the hit ratio. Then wait for the puts to land
        (a reader's epoch ends; the next starts on a settled cache)."""
        hits = 0
        for k in keys:
            if self.client.lookup([k])[0] is not None:
                hits += 1
            else:
                self.client.put(k, self.sealed(k))
        self.daemon.wait_idle()
        return hits / len(keys) if keys else 0.0

    def stats(self) -> dict:
        return self.client.stats()

    def sealed(self, k: str) -> bytes:
        blob = self._sealed.get(k)
        if blob is None:
            blob = blockfile.seal(k, self.payload, VOLUME_KEY, chunk_size=blockfile.MIN_CHUNK)
            if len(self._sealed) < 20_000:
                self._sealed[k] = blob
        return blob


@dataclass
class Result:
    scenario: str
    phase: str
    hit_ratio: float
    optimum: float
    want: float            # the target, as a ratio (want <= hit_ratio)
    notes: dict = field(default_factory=dict)

    @property
    def met(self) -> bool:
        return self.hit_ratio >= self.want - 1e-9


def shuffled(keys: list[str], seed) -> list[str]:
    out = list(keys)
    random.Random(str(seed)).shuffle(out)
    return out


def file_bytes(scale: Scale) -> int:
    return blockfile.BlockHeader(b"\0" * 8, b"\0" * 16, scale.block_bytes,
                                 blockfile.MIN_CHUNK).file_size


def usable_blocks(scale: Scale) -> int:
    return int(HIGH_WATERMARK * scale.blocks * file_bytes(scale)) // file_bytes(scale)


def start_daemon(tmp: Path, scale: Scale, config: str = "") -> DaemonProcess:
    args = []
    if config:
        (tmp / "blockcached.toml").write_text(config)
        args = ["--config", str(tmp / "blockcached.toml")]
    d = DaemonProcess(tmp, [(tmp / "cache", str(scale.blocks * file_bytes(scale)))], args)
    return d.start()


def on_daemon(tmp_root: str | None = None) -> OpenCache:
    """Each scenario's cache: a real `blockcached` with one cache dir of
    `scale.blocks` blocks, under a fresh dir in `tmp_root`."""
    @contextmanager
    def open_cache(scale: Scale, quotas: dict[str, int]) -> Iterator[CacheReader]:
        tmp = Path(tempfile.mkdtemp(prefix="bc-capacity-", dir=tmp_root))
        config = "".join(f"[volumes.{v}]\nmax_bytes = {b}\n\n" for v, b in quotas.items())
        d = start_daemon(tmp, scale, config)
        try:
            yield Reader(d, scale.block_bytes)
        finally:
            d.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    return open_cache


def shuffled_epochs(scale: Scale, times: float, epochs: int = 5,
                    cache: OpenCache | None = None) -> list[Result]:
    data = [key("data", i) for i in range(int(scale.blocks * times))]
    optimum = min(1.0, usable_blocks(scale) / len(data))
    want = 0.99 if times <= 1 else 0.9 * optimum
    out = []
    with (cache or on_daemon())(scale, {}) as r:
        for e in range(1, epochs + 1):
            ratio = r.epoch(shuffled(data, e))
            if e > 1:
                out.append(Result(f"shuffled {times}x", f"epoch {e}", ratio, optimum, want))
    return out


def working_set_change(scale: Scale, cache: OpenCache | None = None) -> list[Result]:
    a = [key("joba", i) for i in range(int(scale.blocks * 1.5))]
    b = [key("jobb", i) for i in range(int(scale.blocks * 0.8))]
    out = []
    with (cache or on_daemon())(scale, {}) as r:
        for e in range(1, 4):
            r.epoch(shuffled(a, f"a{e}"))
        for e in range(1, 4):
            ratio = r.epoch(shuffled(b, f"b{e}"))
            out.append(Result("working set A -> B", f"B epoch {e}", ratio, 1.0,
                              0.95 if e == 3 else 0.0))
        s = r.stats()
    out[-1].notes["A blocks left"] = s["volumes"].get("joba", {}).get("entries", 0)
    out[-1].notes["demoted"] = s["policy"].get("demoted", 0)
    return out


def hot_and_cold_sweep(scale: Scale, cache: OpenCache | None = None) -> list[Result]:
    hot = [key("hot", i) for i in range(scale.blocks // 2)]
    cold = [key("cold", i) for i in range(scale.blocks * 3)]
    rng = random.Random(4)
    hot_hits = hot_reads = 0
    with (cache or on_daemon())(scale, {}) as r:
        for e in range(1, 4):
            r.epoch(shuffled(hot, e))
        for i, k in enumerate(cold):  # training goes on during the sweep
            r.epoch([k])
            if i % 2:
                hot_reads += 1
                hot_hits += r.epoch([rng.choice(hot)]) == 1.0
        after = r.epoch(shuffled(hot, "after"))
    return [Result("hot set + cold sweep", "hot, during the sweep", hot_hits / hot_reads,
                   1.0, 0.9),
            Result("hot set + cold sweep", "hot, after the sweep", after, 1.0, 0.9)]


def quotas(scale: Scale, cache: OpenCache | None = None) -> list[Result]:
    open_cache = cache or on_daemon()
    share = scale.blocks * file_bytes(scale) // 2
    limits = {"big": share, "small": share}
    small = [key("small", i) for i in range(int(scale.blocks * 0.4))]
    big = [key("big", i) for i in range(int(scale.blocks * 1.5))]  # 3x its half

    with open_cache(scale, limits) as r:
        base = [Result("quotas", f"small alone, epoch {e}", r.epoch(shuffled(small, e)), 1.0, 0.0)
                for e in range(1, 4)][1:]
    mixed = []
    with open_cache(scale, limits) as r:
        for e in range(1, 4):
            # the two readers take turns block by block
            turns = [k for pair in zip(shuffled(big, e), shuffled(small, e) + [None] * len(big))
                     for k in pair if k is not None]
            hits = {"big": 0, "small": 0}
            for k in turns:
                hits[k.split("_")[0]] += r.epoch([k]) == 1.0
            if e > 1:
                mixed.append((hits["small"] / len(small), hits["big"] / len(big)))
        s = r.stats()
    out = []
    for b, (small_ratio, big_ratio) in zip(base, mixed):
        out.append(Result("quotas", b.phase.replace("alone", "beside big"),
                          small_ratio, b.hit_ratio, b.hit_ratio,
                          {"big hit ratio": round(big_ratio, 3),
                           "big optimum": round(min(1.0, share / file_bytes(scale) / len(big)), 3),
                           "big used/quota": f"{s['volumes']['big']['used_bytes']}/{share}"}))
    return base + out


def run_all(scale: Scale, cache: OpenCache | None = None) -> list[Result]:
    return (shuffled_epochs(scale, 1.5, cache=cache) + shuffled_epochs(scale, 3, cache=cache)
            + shuffled_epochs(scale, 0.9, epochs=3, cache=cache)
            + working_set_change(scale, cache) + hot_and_cold_sweep(scale, cache)
            + quotas(scale, cache))


def table(results: list[Result]) -> str:
    lines = [f"{'SCENARIO':<22} {'PHASE':<26} {'HIT RATIO':>9} {'OPTIMUM':>8} {'TARGET':>8}  MET",
             ]
    for r in results:
        met = "" if r.want <= 0 else ("yes" if r.met else "NO")
        notes = "  " + ", ".join(f"{k} {v}" for k, v in r.notes.items()) if r.notes else ""
        lines.append(f"{r.scenario:<22} {r.phase:<26} {r.hit_ratio:>9.3f} {r.optimum:>8.3f} "
                     f"{(f'{r.want:.3f}' if r.want > 0 else '-'):>8}  {met}{notes}")
    return "\n".join(lines)
