"""Workload `prefetch`: a cold epoch read by DataLoader-like workers, with and
without `prefetch_ahead` in the main process.

    python -m bench prefetch                          # 3,000 files
    python -m bench prefetch --size tiny              # 300 files, a quick run
    python -m bench.prefetch --files 1000

The ImageNet-like files of the suite (`datasets.small_file_size`, ~110 KiB,
in 30 class dirs) on a local dir reached through `latency::` (every request
pays the delay). Like `DataLoader(num_workers=4)`: 4 spawned worker
processes, the main process walks the epoch's shuffled order and hands each
file to the next worker, at most 2 per worker outstanding (prefetch_factor).
The dataset's index (the files' `FileInfo`s, or the mount's tree) is listed
before the clock starts, as a Dataset's constructor does. Each case starts
from an empty cache (the volume evicted) and new workers.

Cases, each without and with `prefetch_ahead(volume, order, depth=64)`:
- Volume workers, the remote 20 ms away: target >= 8x the files/s without;
- Volume workers, 2 ms away: >= 1.5x;
- workers reading a FUSE mount (fsclient) of the same volume, 20 ms away,
  the helper in the main process: >= 5x.
In every case with the helper, the most requests in flight at the remote
(the main process's `latency::`, counted by devtools/latencyfs.py) must not
exceed the depth. Results: stdout and bench/results/<date>-prefetch.md;
exit 0 if every target is met.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import random
import sys
import time
from dataclasses import dataclass, field

from blockcache_client import Client, Volume, prefetch_ahead
from devtools.demo import Demo

from . import datasets
from .systems import proc_cpu

WORKERS = 4
PER_WORKER = 2            # items outstanding per worker (DataLoader's prefetch_factor)
DEPTH = 64
DEFAULT_FILES = 3000
DIRS = 30
VOLUME = "demo"           # the name Demo's mount config gives the volume
RESULTS = os.path.join(os.path.dirname(__file__), "results")


@dataclass
class Case:
    name: str
    target: float
    delay: float
    fuse: bool
    seconds: dict[bool, float] = field(default_factory=dict)   # helper? -> epoch seconds
    workers: dict[bool, dict] = field(default_factory=dict)    # helper? -> readers' counts
    helper: dict = field(default_factory=dict)                 # prefetch_ahead's stats
    max_in_flight: int = 0
    cpu: dict[bool, dict[str, float]] = field(default_factory=dict)  # CPU s by process

    @property
    def ratio(self) -> float:
        return self.seconds[False] / self.seconds[True]


def make_files(root: str, n: int) -> list[tuple[str, int]]:
    files = []
    for i in range(n):
        rel = f"train/n{i % DIRS:08d}/{i:08d}.JPEG"
        size = datasets.small_file_size(i)
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(datasets.expected_bytes(rel, size))
        files.append((rel, size))
    return files


# -- the workers ---------------------------------------------------------------

def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _worker(spec: dict, tasks, results) -> None:
    """One DataLoader worker: reads each item it is given, answers its size."""
    vol = None
    if spec["kind"] == "volume":
        vol = Volume(VOLUME, spec["source"], spec["key_file"], socket_path=spec["socket"],
                     latency={"delay": spec["delay"]})
    results.put("ready")
    cpu0 = _cpu()
    while True:
        item = tasks.get()
        if item is None:
            results.put({**(vol.stats() if vol is not None else {}), "cpu": _cpu() - cpu0})
            if vol is not None:
                vol.close()
            return
        try:
            if vol is not None:
                n = len(vol.read(item.path, 0, item.size, info=item))
            else:
                with open(os.path.join(spec["mount"], item), "rb", buffering=0) as f:
                    n = len(f.read())
        except Exception as exc:  # the coordinator stops the run with it
            results.put(f"{item}: {exc!r}")
            continue
        results.put(n)


class Workers:
    """WORKERS spawned processes fed in turn, like a DataLoader's."""

    def __init__(self, spec: dict):
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(WORKERS)]
        self.procs = [ctx.Process(target=_worker, args=(spec, q, self.results), daemon=True)
                      for q in self.tasks]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self._get("ready")

    def _get(self, want=None):
        got = self.results.get(timeout=300)
        if isinstance(got, str) and got != want:
            raise RuntimeError(f"a worker failed: {got}")
        return got

    def epoch(self, items) -> float:
        """Seconds to hand out and read every item."""
        sent = done = 0
        t0 = time.monotonic()
        for item in items:
            while sent - done >= WORKERS * PER_WORKER:
                self._get()
                done += 1
            self.tasks[sent % WORKERS].put(item)
            sent += 1
        while done < sent:
            self._get()
            done += 1
        return time.monotonic() - t0

    def close(self) -> dict:
        """Stop the workers; the sum of their Volume counters."""
        for q in self.tasks:
            q.put(None)
        total: dict = {}
        try:
            for _ in self.procs:
                for k, v in self._get().items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        total[k] = total.get(k, 0) + v
        finally:
            for p in self.procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        return total


# -- the cases -----------------------------------------------------------------

class Bench:
    def __init__(self, demo: Demo, remote: str, config: str, files: list[tuple[str, int]]):
        self.demo, self.remote, self.config = demo, remote, config
        self.key_file = os.path.join(demo.tmp, "demo.key")
        self.order = [rel for rel, _ in files]
        random.Random(1).shuffle(self.order)

    def volume(self, delay: float) -> Volume:
        return Volume(VOLUME, f"latency::file://{self.remote}", self.key_file,
                      socket_path=self.demo.socket, latency={"delay": delay})

    def empty_cache(self) -> None:
        self.demo.daemon.wait_idle(60)
        with Client(self.demo.socket) as c:
            c.evict(volume=VOLUME)
        self.demo.daemon.wait_idle(60)

    def server_pids(self, fuse: bool) -> dict[str, int]:
        pids = {"daemon": self.demo.daemon.proc.pid}
        if fuse:
            pids["mount"] = self.demo.mount_proc.pid
        return pids

    def run(self, case: Case) -> None:
        for helper in (False, True):
            self.empty_cache()
            main = self.volume(case.delay)
            try:
                infos = {f.path: f for d in main.listdir("train") for f in main.listdir(d.path)}
                if case.fuse:
                    self.demo.mount(self.config)
                    for _ in os.walk(self.demo.mountpoint):  # the Dataset's own listing
                        pass
                    spec = {"kind": "posix", "mount": self.demo.mountpoint}
                    items = list(self.order)
                else:
                    spec = {"kind": "volume", "source": f"latency::file://{self.remote}",
                            "key_file": self.key_file, "socket": self.demo.socket,
                            "delay": case.delay}
                    items = [infos[p] for p in self.order]
                workers = Workers(spec)
                try:
                    fs = main.backend.fs
                    fs.max_in_flight = 0
                    if helper:
                        ahead = prefetch_ahead(main, range(len(items)), depth=DEPTH,
                                               path_of=lambda i: self.order[i])
                        gen = (items[i] for i in ahead)
                    else:
                        gen = iter(items)
                    servers = self.server_pids(case.fuse)
                    cpu0 = {"main": _cpu(), **{k: proc_cpu(p) for k, p in servers.items()}}
                    case.seconds[helper] = workers.epoch(gen)
                    cpu = {"main": _cpu(), **{k: proc_cpu(p) for k, p in servers.items()}}
                    if helper:
                        case.helper = ahead.stats()
                        case.max_in_flight = fs.max_in_flight
                finally:
                    counts = workers.close()
                case.workers[helper] = self.demo.stats() if case.fuse else counts
                case.cpu[helper] = {k: cpu[k] - cpu0[k] for k in cpu}
                case.cpu[helper]["workers"] = counts.get("cpu", 0.0)
            finally:
                main.close()
                if case.fuse:
                    self.demo.unmount()
            print(f"  {case.name}, {'with' if helper else 'without'} prefetch_ahead: "
                  f"{case.seconds[helper]:.2f} s", flush=True)


def table(cases: list[Case], n: int) -> tuple[str, bool]:
    """The figures, the verdicts, and whether every target is met. CPU: ms per
    file of the main process (dispatch, and the helper's fetch, seal, put),
    the workers, the daemon and the mount; "cores": all of it over the wall
    time (2 = both CPUs of the reference machine busy all along)."""
    parts = ("main", "workers", "daemon", "mount")
    lines = [f"{'case':<18} {'helper':<7} {'seconds':>7} {'files/s':>7} {'hits':>5} "
             f"{'misses':>6} {'remote MB':>9}  CPU ms/file: "
             + " ".join(f"{p:>7}" for p in parts) + f" {'cores':>5}"]
    for c in cases:
        for helper in (False, True):
            w, cpu, secs = c.workers[helper], c.cpu[helper], c.seconds[helper]
            lines.append(f"{c.name:<18} {'with' if helper else 'without':<7} {secs:>7.2f} "
                         f"{n / secs:>7.0f} {w.get('hits', 0):>5} {w.get('misses', 0):>6} "
                         f"{w.get('backend_bytes', 0) / 1e6:>9.1f}  {'':12} "
                         + " ".join(f"{cpu.get(p, 0) / n * 1e3:>7.2f}" for p in parts)
                         + f" {sum(cpu.values()) / secs:>5.2f}")
    lines.append("")
    ok = True
    for c in cases:
        met = c.ratio >= c.target
        ok &= met
        lines.append(f"{'MET ' if met else 'MISS'} {c.name}: with/without {c.ratio:.1f}x "
                     f"(target >= {c.target:g}x); helper: {c.helper}")
    worst = max(c.max_in_flight for c in cases)
    ok &= worst <= DEPTH
    lines.append(f"{'MET ' if worst <= DEPTH else 'MISS'} most requests in flight at the "
                 f"remote with the helper: {worst} (depth {DEPTH})")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefetch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=DEFAULT_FILES,
                   help="files in the epoch (%(default)s)")
    p.add_argument("--out", default=RESULTS, help="where the results file goes")
    a = p.parse_args(argv)
    if a.files < WORKERS:
        p.error(f"--files must be at least {WORKERS} (one per worker)")
    demo = Demo(argparse.Namespace(delay=0.020, keep=False))
    try:
        remote = os.path.join(demo.tmp, "remote")
        t0 = time.monotonic()
        files = make_files(remote, a.files)
        print(f"{a.files} files, {sum(s for _, s in files) / 1e6:.0f} MB, made in "
              f"{time.monotonic() - t0:.1f} s; {WORKERS} workers, depth {DEPTH}", flush=True)
        demo.start_daemon()
        bench = Bench(demo, remote, demo.write_config(remote), files)
        cases = [Case("Volume, 20 ms", 8.0, 0.020, False),
                 Case("Volume, 2 ms", 1.5, 0.002, False),
                 Case("FUSE mount, 20 ms", 5.0, 0.020, True)]
        for case in cases:
            bench.run(case)
    finally:
        demo.cleanup()
    text, ok = table(cases, a.files)
    print(text)
    os.makedirs(a.out, exist_ok=True)
    stem = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    path = os.path.join(a.out, f"{stem}-prefetch.md")
    with open(path, "w") as f:
        f.write(f"{a.files} files, {os.cpu_count()} CPUs\n\n```\n{text}\n```\n")
    print(f"results: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
