"""Workload `fio`: fsclient on a fresh mount over a warm cache, against the
pyfuse3 passthrough (`bench.passthrough`) on a fresh mount of the same
page-cached local file, both read by Debian's fio.

    python -m bench.fio [--mib 512] [--runtime 10] [--rounds 3]

What a new job on a host sees: a 512 MiB file, read once through fsclient so
the host's block cache holds it, then for each round and each side a fresh
mount (nothing in the mount's page cache or the reader's memory), the cache
files (or the local file) read into the host page cache first, untimed:

- 4 KiB random reads, 2 jobs, `--runtime` seconds: IOPS. Target: fsclient
  >= 0.8x the passthrough. fio runs with `--invalidate=0`, so neither job
  empties the page cache the other is reading.
- 1 MiB sequential reads of the whole file, 1 job: MB/s. Target: >= 0.9x.

fsclient runs twice per round: as configured by default, where random
reads put their chunk's other pages in the kernel's page cache
(`store_pages`, `fsclient.pagestore`: most of its random-read IOPS are then
page-cache hits the store made), and with `store_pages = false`, every read
a request to the server. The sides rotate their order by round;
each round's ratios to the passthrough and their medians are printed with
the machine's load average, the FUSE server's CPU time per read (per MiB
for sequential reads) on each side, and for fsclient the READ requests that
reached it and its CPU per such request: on 2 cores the server, fio and the
kernel share the CPU, so that is what the ratio comes down to. fio is
apt-installed when missing (root). Results go to stdout and
bench/results/fio.json; the exit code is 0 when the default fsclient meets
both targets.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from bench.fuse_vs_passthrough import RESULTS, cpu_seconds, start_passthrough
from bench.systems import _apt_install, read_into_page_cache
from devtools.demo import Demo, stop_mount

FILE = "data.bin"
TARGETS = {"rand4k": 0.8, "seq1m": 0.9}
PER = {"rand4k": "per read", "seq1m": "per MiB"}
# fsclient as configured by default, and with `store_pages = false` (fsclient.pagestore)
SIDES = ["passthrough", "fsclient", "fsclient-nostore"]


def fio(path: str, kind: str, runtime: float) -> float:
    """Run fio once on `path`: IOPS for "rand4k", MB/s for "seq1m"."""
    # --invalidate=0: fio's default drops the file's page cache each time a
    # job starts a pass, so 2 jobs out of step would empty the cache the other
    # reads (and a fresh mount starts empty anyway)
    common = ["fio", f"--filename={path}", "--readonly", "--ioengine=psync", "--invalidate=0",
              "--group_reporting", "--output-format=json"]
    if kind == "rand4k":
        args = ["--name=rand4k", "--rw=randread", "--bs=4k", "--numjobs=2", "--time_based",
                f"--runtime={runtime:g}"]
    else:
        args = ["--name=seq1m", "--rw=read", "--bs=1M", "--numjobs=1"]
    res = subprocess.run(common + args, capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise RuntimeError(f"fio failed: {(res.stderr or res.stdout).strip()[-500:]}")
    job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]["read"]
    return job["iops"] if kind == "rand4k" else job["bw_bytes"] / 1e6


def server_pid(keeper: int) -> int:
    """The fsclient server: the keeper's child."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{keeper}/task/{keeper}/children") as f:
            children = f.read().split()
        if children:
            return int(children[0])
        time.sleep(0.02)
    raise RuntimeError("the fsclient keeper started no server")


def timed_fio(pid: int, path: str, kind: str, runtime: float) -> tuple[float, float]:
    """fio's result and the FUSE server's CPU seconds during it."""
    before = cpu_seconds(pid)
    result = fio(path, kind, runtime)
    return result, cpu_seconds(pid) - before


def read_requests(mountpoint: str) -> int:
    """READ requests the fsclient mount has served so far."""
    stats = json.loads(os.getxattr(mountpoint, "user.blockcache.stats"))
    return stats["fsclient"]["ops"].get("read", 0)


def run_ours(demo: Demo, config: str, remote: str, kind: str,
             runtime: float) -> tuple[float, float, int]:
    """One fio run on a fresh fsclient mount over the warm block cache: fio's
    result, the server's CPU seconds and the READ requests that reached it
    (fewer than fio's reads when pages were put in the page cache ahead)."""
    demo.mount(config)
    try:
        pid = server_pid(demo.mount_proc.pid)  # type: ignore[union-attr]
        read_into_page_cache([os.path.join(demo.tmp, "cache")])
        before = read_requests(demo.mountpoint)
        result, cpu = timed_fio(pid, os.path.join(demo.mountpoint, FILE), kind, runtime)
        return result, cpu, read_requests(demo.mountpoint) - before
    finally:
        demo.unmount()


def run_passthrough(demo: Demo, remote: str, kind: str, runtime: float) -> tuple[float, float]:
    """One fio run on a fresh passthrough mount of the page-cached local file."""
    proc = start_passthrough(demo, remote, None)
    try:
        read_into_page_cache([remote])
        return timed_fio(proc.pid, os.path.join(demo.mountpoint, FILE), kind, runtime)
    finally:
        stop_mount(proc, demo.mountpoint)


def cpu_per_op(result: float, cpu: float, kind: str, runtime: float, mib: int) -> float:
    """Server CPU microseconds per read (rand4k) or per MiB read (seq1m)."""
    ops = result * runtime if kind == "rand4k" else mib
    return cpu / ops * 1e6 if ops else 0.0


def fill_cache(demo: Demo, config: str) -> None:
    """Read the file once through fsclient: every block into the host's cache."""
    demo.mount(config)
    try:
        with open(os.path.join(demo.mountpoint, FILE), "rb") as f:
            while f.read(1 << 20):
                pass
        demo.wait_fills()
    finally:
        demo.unmount()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fio", description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=512, help="size of the file read")
    p.add_argument("--runtime", type=float, default=10.0, help="seconds per random-read run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=RESULTS, help="where fio.json goes")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    why = _apt_install("fio", "fio")
    if why is not None:
        print(f"bench.fio: {why}", file=sys.stderr)
        return 1
    args.delay = 0.002  # the remote of the one cold read (Demo's config)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    demo = Demo(args)
    # fio's result, the server's us of CPU per read (per MiB) and per READ request
    # that reached it, per kind and side; sides alternate their order by round
    runs: dict[str, dict[str, list[tuple[float, float, float]]]] = {
        k: {side: [] for side in SIDES} for k in TARGETS}
    try:
        remote = os.path.join(demo.tmp, "remote")
        os.makedirs(remote)
        with open(os.path.join(remote, FILE), "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        demo.start_daemon()
        config = demo.write_config(remote)
        unstored = os.path.join(demo.tmp, "no_store_pages.toml")
        with open(config) as src, open(unstored, "w") as dst:
            head, _, rest = src.read().partition("[storage_options]")
            dst.write(f"{head}store_pages = false\n[storage_options]{rest}")
        configs = {"fsclient": config, "fsclient-nostore": unstored}
        fill_cache(demo, config)
        for r in range(args.rounds):
            for kind in TARGETS:
                order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]
                for side in order:
                    if side == "passthrough":
                        result, cpu = run_passthrough(demo, remote, kind, args.runtime)
                        requests = 0
                    else:
                        result, cpu, requests = run_ours(demo, configs[side], remote, kind,
                                                         args.runtime)
                    runs[kind][side].append(
                        (result, cpu_per_op(result, cpu, kind, args.runtime, args.mib),
                         cpu / requests * 1e6 if requests else 0.0))
                peer = runs[kind]["passthrough"][-1][0]
                print(f"round {r + 1} {kind}: " + "; ".join(
                    f"{side} {runs[kind][side][-1][0]:,.0f} ({runs[kind][side][-1][0] / peer:.2f}x"
                    f", server CPU {runs[kind][side][-1][1]:,.0f} us {PER[kind]}"
                    + (f", {runs[kind][side][-1][2]:,.0f} us per READ request it served)"
                       if side != "passthrough" else ")") for side in SIDES), flush=True)
    finally:
        demo.cleanup()
    load = os.getloadavg()
    out: dict = {"mib": args.mib, "runtime_s": args.runtime, "load_average": load}
    print(f"\nfio on a {args.mib} MiB file, fresh mounts over warm caches; load average "
          f"{load[0]:.1f} {load[1]:.1f} on {os.cpu_count()} cpus; fsclient's random-read IOPS "
          f"are mostly page-cache hits its store made; fsclient-nostore: store_pages = false")
    for kind, unit in (("rand4k", "IOPS (4 KiB random, 2 jobs)"),
                       ("seq1m", "MB/s (1 MiB sequential)")):
        peers = [x[0] for x in runs[kind]["passthrough"]]
        out[kind] = {"target_min": TARGETS[kind], "passthrough": peers}
        for side in SIDES[1:]:
            rows = runs[kind][side]
            ratios = [x[0] / p for x, p in zip(rows, peers)]
            out[kind][side] = {"results": [x[0] for x in rows], "ratios": ratios,
                               "median_ratio": statistics.median(ratios),
                               f"server_cpu_us_{PER[kind].replace(' ', '_')}": [x[1] for x in rows],
                               "server_cpu_us_per_read_request": [x[2] for x in rows]}
            print(f"{unit:30} {side:15} {statistics.median(x[0] for x in rows):9,.0f}  "
                  f"passthrough {statistics.median(peers):9,.0f}  ratio per round "
                  + ", ".join(f"{x:.2f}x" for x in ratios)
                  + f"; median {statistics.median(ratios):.2f}x (target >= {TARGETS[kind]}x)")
            print(f"{'':30} server CPU {PER[kind]}: {side} "
                  f"{statistics.median(x[1] for x in rows):,.0f} us, passthrough "
                  f"{statistics.median(x[1] for x in runs[kind]['passthrough']):,.0f} us; "
                  f"{side} per READ request it served: "
                  f"{statistics.median(x[2] for x in rows):,.0f} us (medians)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fio.json"), "w") as f:
        json.dump(out, f, indent=2)
    return 0 if all(out[k]["fsclient"]["median_ratio"] >= t for k, t in TARGETS.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
