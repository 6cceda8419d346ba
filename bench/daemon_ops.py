"""Benchmark of `blockcached`: lookups, puts, rebuild, index memory.

    python -m bench.daemon_ops [--entries N] [--million] [--dir DIR]

Prints, measured in one run against a real daemon process on this machine:

- lookup round trip p50/p99 (one key per request) on one connection, and on
  4 connections from 4 processes at once;
- batched lookups/s (4096 keys per request);
- put MB/s (1 MiB blocks, until written) against writing the same files into
  the same file system directly: with the daemon's own steps (tmp file +
  rename, no fsync: see blockcached/DESIGN.md, "Why blocks are not
  fsynced"), which the target is measured against, and for reference
  crash-safely (tmp + fsync + rename) and plainly (open/write/close);
- rebuild: entries/s of the start-up scan over N block files (200k default,
  1M with --million) and the daemon's RSS per index entry.

Targets: lookup p50 <= 80 us; batched >= 100k keys/s; put >= 50% of the
direct rate; rebuild >= 100k entries/s; <= 250 B RSS per entry.

On a small shared VM every figure moves with the load and with vCPU wake-up
cost: run it on a quiet machine, and compare runs of one session. Puts and
direct writes alternate over `PUT_ROUNDS` rounds (median of each), since a
write's cost depends on whether its page-cache pages were just freed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from blockcache_client.contract import blockfile, layout
from blockcache_client.contract.blockkey import BlockKey
from blockcache_client.daemonclient.client import Client
from blockcached.scan import MIN_BLOCK_FILE
from devtools.daemon import DaemonProcess

VOLUME_KEY = bytes(32)
LOOKUPS = 20_000
PUT_BLOCK = 1 << 20
PUT_COUNT = 128
PUT_ROUNDS = 3


def _key(i: int, vol: str = "imagenet") -> str:
    return str(BlockKey(vol, 1_000_000 + i // 16, 0x5eed5eed5eed5eed, (i % 16) << 20))


def _pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _lookup_latencies(sock: str, keys: list[str], n: int) -> list[float]:
    c = Client(sock)
    c.ping()
    out = []
    for i in range(n):
        k = keys[i % len(keys)]
        t = time.perf_counter()
        c.lookup([k])
        out.append(time.perf_counter() - t)
    c.close()
    return out


def _worker(args: tuple[str, list[str], int]) -> list[float]:
    return _lookup_latencies(*args)


def bench_lookups(sock: str, keys: list[str]) -> dict[str, float]:
    one = _lookup_latencies(sock, keys, LOOKUPS)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        many = [x for part in pool.map(_worker, [(sock, keys, LOOKUPS // 2)] * 4) for x in part]
    c = Client(sock)
    batch = keys[:4096]
    c.lookup(batch)
    t = time.perf_counter()
    rounds = 50
    for _ in range(rounds):
        c.lookup(batch)
    batched = rounds * len(batch) / (time.perf_counter() - t)
    c.close()
    return {"p50_1": _pct(one, 50), "p99_1": _pct(one, 99),
            "p50_4": _pct(many, 50), "p99_4": _pct(many, 99), "batched": batched}


def _write_direct(root: Path, blobs: list[tuple[str, bytes]], tmp: bool, fsync: bool) -> float:
    """Seconds to write `blobs` into the layout under `root`: through a temp
    file renamed into place or not, fsynced or not."""
    tmpdir = root / "tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    for i, (k, blob) in enumerate(blobs):
        final = root / layout.block_relpath(k)
        final.parent.mkdir(parents=True, exist_ok=True)
        path = tmpdir / str(i) if tmp else final
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, blob)
        os.fchmod(fd, 0o644)  # as the daemon does (umask must not hide blocks)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        if tmp:
            os.rename(path, final)
    return time.perf_counter() - t


def _puts_until_written(d: DaemonProcess, c: Client, blobs: list[tuple[str, bytes]]) -> float:
    """Seconds to put `blobs` through the daemon until all are written; then
    evicts them and waits until the files are gone and the disk is synced,
    so nothing of this round competes with the next."""
    t = time.perf_counter()
    for k, blob in blobs:
        while True:
            ok, reason = c.put(k, blob)
            if ok or reason != "queue_full":
                break
            time.sleep(0.001)
    # Until written: poll finely (20 ms steps would be a tenth of the whole
    # measurement at this rate), on the connection already open.
    d.wait_stats(lambda s: not s["queue"]["entries"], 300, interval=0.0005, client=c)
    seconds = time.perf_counter() - t
    c.evict(volume="puts")
    # the evicted files are unlinked by the daemon's disk worker: let that
    # finish (and the written blocks reach the disk)
    files = [os.path.join(cache, layout.block_relpath(k)) for cache in d.cache_dirs
             for k, _ in blobs]
    deadline = time.monotonic() + 300
    while any(map(os.path.lexists, files)):
        if time.monotonic() > deadline:
            raise TimeoutError("the daemon did not unlink the evicted puts within 300 s")
        time.sleep(0.01)
    os.sync()
    return seconds


def _direct_round(root: Path, blobs: list[tuple[str, bytes]], tmp: bool, fsync: bool) -> float:
    """`_write_direct`, then the files removed and the disk synced."""
    seconds = _write_direct(root, blobs, tmp=tmp, fsync=fsync)
    shutil.rmtree(root)
    os.sync()
    return seconds


def bench_puts(d: DaemonProcess, base: Path) -> dict[str, float]:
    """Puts against direct writes of the same blocks, in alternating rounds
    (median of each): one round of each in a fixed order compares page-cache
    states (pages just freed, or given back to the host), not the two paths."""
    blobs = []
    plain = os.urandom(PUT_BLOCK - 4096)
    for i in range(PUT_COUNT):
        k = _key(i, "puts")
        blobs.append((k, blockfile.seal(k, plain, VOLUME_KEY)))
    total = sum(len(b) for _, b in blobs) / 1e6
    c = d.client()
    direct = base / "direct"
    daemon_s, same_s = [], []
    for r in range(PUT_ROUNDS):
        daemon_s.append(_puts_until_written(d, c, blobs))
        same_s.append(_direct_round(direct / f"same{r}", blobs, tmp=True, fsync=False))
    durable_s = _direct_round(direct / "durable", blobs, tmp=True, fsync=True)
    plain_s = _direct_round(direct / "plain", blobs, tmp=False, fsync=False)
    shutil.rmtree(direct, ignore_errors=True)
    return {"daemon": total / statistics.median(daemon_s),
            "same": total / statistics.median(same_s),
            "durable": total / durable_s, "plain": total / plain_s}


def populate(cache_dir: Path, n: int) -> None:
    """N minimal block files (header + tag) straight into the layout; the scan
    checks names, placement and sizes, not contents."""
    payload = b"\0" * MIN_BLOCK_FILE
    made: set[str] = set()
    for i in range(n):
        k = _key(i, "rebuild")
        p = cache_dir / layout.block_relpath(k)
        parent = str(p.parent)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, payload)
        os.close(fd)
        if i % 50_000 == 0 and i:
            print(f"  populated {i} files", flush=True)


def bench_rebuild(base: Path, n: int) -> dict[str, float]:
    cache = base / "rebuild-cache"
    empty = DaemonProcess(base / "empty", extra_args=["--log-level", "warning"])
    (base / "empty").mkdir(exist_ok=True)
    with empty:
        empty.wait_rebuilt()
        time.sleep(0.5)
        rss_empty = _rss_kib(empty.proc.pid)
    print(f"  writing {n} block files for the rebuild ...", flush=True)
    populate(cache, n)
    os.system("sync")
    (base / "full").mkdir(exist_ok=True)
    d = DaemonProcess(base / "full", cache_dirs=[(cache, "1T")],
                      extra_args=["--log-level", "warning"])
    t0 = time.perf_counter()
    d.start(wait_rebuilt=False)
    try:
        served = time.perf_counter() - t0
        s = d.wait_rebuilt(timeout=600)
        wall = time.perf_counter() - t0
        time.sleep(0.5)
        rss_full = _rss_kib(d.proc.pid)
        assert s["entries"] == n, s["entries"]
    finally:
        d.stop()
    shutil.rmtree(cache)
    return {"served_s": served, "scan_s": s["rebuild"]["seconds"], "wall_s": wall,
            "rate": n / s["rebuild"]["seconds"],
            "rss_per_entry": (rss_full - rss_empty) * 1024 / n,
            "rss_empty_mib": rss_empty / 1024, "rss_full_mib": rss_full / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=200_000, help="block files for the rebuild")
    ap.add_argument("--million", action="store_true", help="rebuild over 1M block files")
    ap.add_argument("--dir", default=None, help="where to put cache dirs (default: a tmp dir)")
    args = ap.parse_args()
    n = 1_000_000 if args.million else args.entries
    base = Path(tempfile.mkdtemp(prefix="bench-daemon-", dir=args.dir))
    try:
        d = DaemonProcess(base, extra_args=["--log-level", "warning"])
        with d:
            c = d.client()
            keys = []
            for i in range(4096):
                k = _key(i)
                blob = blockfile.seal(k, b"", VOLUME_KEY)
                while not c.put(k, blob)[0]:
                    time.sleep(0.001)
                keys.append(k)
            d.wait_idle(timeout=120)
            lk = bench_lookups(d.socket_path, keys)
            pt = bench_puts(d, base)
        rb = bench_rebuild(base, n)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def line(name: str, value: str, target: str, ok: bool) -> None:
        print(f"{name:<44} {value:>16}   target {target:<18} {'ok' if ok else 'MISSED'}")

    print()
    us = 1e6
    line("lookup p50, 1 connection", f"{lk['p50_1'] * us:.0f} us", "<= 80 us",
         lk["p50_1"] * us <= 80)
    line("lookup p99, 1 connection", f"{lk['p99_1'] * us:.0f} us", "-", True)
    line("lookup p50, 4 connections (4 processes)", f"{lk['p50_4'] * us:.0f} us", "<= 80 us",
         lk["p50_4"] * us <= 80)
    line("lookup p99, 4 connections", f"{lk['p99_4'] * us:.0f} us", "-", True)
    line("batched lookups (4096 keys/request)", f"{lk['batched']:,.0f} keys/s", ">= 100k keys/s",
         lk["batched"] >= 100_000)
    line("put via daemon (1 MiB blocks, until written)", f"{pt['daemon']:.0f} MB/s", "-", True)
    line("direct write, tmp+rename (the daemon's steps)", f"{pt['same']:.0f} MB/s", "-", True)
    line("direct write, tmp+fsync+rename", f"{pt['durable']:.0f} MB/s", "-", True)
    line("direct write, plain (page cache only)", f"{pt['plain']:.0f} MB/s", "-", True)
    line("put / direct write, same steps", f"{100 * pt['daemon'] / pt['same']:.0f} %", ">= 50 %",
         pt["daemon"] >= 0.5 * pt["same"])
    line("put / direct crash-safe write", f"{100 * pt['daemon'] / pt['durable']:.0f} %", "-", True)
    line("put / direct plain write", f"{100 * pt['daemon'] / pt['plain']:.0f} %", "-", True)
    line(f"rebuild scan ({n} entries)", f"{rb['rate']:,.0f} entries/s", ">= 100k entries/s",
         rb["rate"] >= 100_000)
    line("socket serving after start", f"{rb['served_s']:.2f} s", "<= 1 s", rb["served_s"] <= 1)
    line("RSS per index entry", f"{rb['rss_per_entry']:.0f} B", "<= 250 B",
         rb["rss_per_entry"] <= 250)
    print(f"(RSS {rb['rss_empty_mib']:.1f} MiB empty, "
          f"{rb['rss_full_mib']:.1f} MiB with {n} entries;"
          f" rebuild wall time {rb['wall_s']:.2f} s)")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {os.cpu_count()} cpus, load average {load} at the end (figures are "
          f"only comparable on an otherwise idle machine)")


if __name__ == "__main__":
    main()
