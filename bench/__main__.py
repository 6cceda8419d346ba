"""`make bench` / `python -m bench`: every system on the same data, one run, one report.

    python -m bench                              # the whole suite (~15 min on 2 cores)
    python -m bench small-files --systems volume,fsspec-simplecache --size small
    python -m bench --size large                 # bigger data, longer run
    python -m bench --publish                    # also write the run into docs/
    python -m bench --from-json docs/benchmarks-results.json --publish   # docs only, no run
    python -m bench capacity                     # the daemon's hit ratios when data outgrows it
    python -m bench cluster                      # hosts sharing blocks through memcached
    python -m bench prefetch                     # cold epochs with and without prefetch_ahead
    python -m bench fio                          # fio on fsclient against the passthrough
    python -m bench restarts                     # reads across server kills and live restarts
    python -m bench checkpoint                   # a checkpoint saved through a writable mount

Set-up is part of the run: matplotlib is pip-installed into this interpreter
when missing, rclone and s3fs-fuse are apt-installed when missing (a system
that cannot be had is skipped, with the reason in the results), the moto S3
server and the latency proxy are started on 127.0.0.1, and the dataset is
generated and uploaded. Everything started is stopped at the end, also on
failure or Ctrl-C. Results: bench/results/<date>.{json,md} and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import time

from . import (
    PROJECT_ROOT,
    capacity,
    checkpoint,
    cluster,
    datasets,
    fio,
    policy_sim,
    prefetch,
    report,
    restarts,
)
from .remote import DEFAULT_RTT_MS, Remote
from .systems import Ctx, _project_version, all_systems
from .workloads import WORKLOADS, Runner

log = logging.getLogger("bench")

# `capacity` runs on our daemon alone, `prefetch` on ours over `latency::`,
# `cluster` on our hosts and a memcached pool, `fio` on fsclient and the passthrough:
# without the other systems
ALL_WORKLOADS = [*WORKLOADS, "capacity", "prefetch", "cluster", "fio", "restarts", "checkpoint"]

RESULTS = os.path.join(PROJECT_ROOT, "bench", "results")


def _ensure_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.info("installing matplotlib (the bench extra) for the plots")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib>=3.7"],
                       stdin=subprocess.DEVNULL, check=False)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [s.name for s in all_systems()]
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                   help=f"workloads to run (default: all): {', '.join(ALL_WORKLOADS)}")
    p.add_argument("--systems", default=",".join(names),
                   help=f"comma-separated systems (default: all): {','.join(names)}")
    p.add_argument("--size", default="default", choices=["tiny", "small", "default", "large"])
    p.add_argument("--rtt-ms", type=float, default=DEFAULT_RTT_MS,
                   help="emulated round trip to the remote (default %(default)s ms)")
    p.add_argument("--workdir", default="/tmp/blockcache-bench",
                   help="scratch: caches, mount points, the local copy")
    p.add_argument("--out", default=RESULTS, help="where results go (default bench/results)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one epoch of one system may take before it is failed")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="do not drop the page cache before cold epochs")
    p.add_argument("--no-warm-host-cache", action="store_true",
                   help="do not read each system's cache files (or local copy) into the "
                        "page cache before its warm epochs")
    p.add_argument("--publish", action="store_true",
                   help="write the run into docs/: its verdicts and every table into "
                        "benchmarks-results.md, the JSON beside, plots into img/")
    p.add_argument("--from-json", metavar="FILE",
                   help="run nothing: rebuild tables and plots (and --publish) from a results file")
    args = p.parse_args(argv)
    for w in args.workloads:
        if w not in ALL_WORKLOADS:
            p.error(f"unknown workload {w!r}; choose from {', '.join(ALL_WORKLOADS)}")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in args.systems:
        if s not in names:
            p.error(f"unknown system {s!r}; choose from {', '.join(names)}")
    return args


def run(args: argparse.Namespace) -> dict:
    """Set up, run every selected workload on every selected system, return the result."""
    t0 = time.monotonic()
    size = datasets.SIZES[args.size]
    systems = [s for s in all_systems() if s.name in args.systems]
    info = {}
    for s in systems:
        why = s.unavailable()
        if why:
            log.warning("skipping %s: %s", s.name, why)
        info[s.name] = {"label": s.label, "kind": s.kind, "ours": s.ours, "unavailable": why,
                        "version": "" if why else s.version(), "settings": s.settings()}
    runnable = [s for s in systems if not info[s.name]["unavailable"]]
    os.makedirs(args.workdir, exist_ok=True)
    local_root = os.path.join(args.workdir, f"local-{size.name}")
    with Remote(rtt_ms=args.rtt_ms, log_path=os.path.join(args.workdir, "moto.log")) as remote:
        data = datasets.upload(size, remote, local_root)
        runner = Runner(Ctx(remote, local_root, args.workdir, size),
                        drop_caches=not args.no_drop_caches,
                        warm_host_cache=not args.no_warm_host_cache, timeout=args.timeout)
        for workload in args.workloads or list(WORKLOADS):
            log.info("workload %s", WORKLOADS[workload])
            for s in runnable:
                runner.run(workload, s)
        remote_info = {"method": remote.method, "note": remote.note, "rtt_ms": args.rtt_ms,
                       "server": "moto " + _version("moto")}
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _project_version(), "size": size.name, "size_settings": size.__dict__,
        "dataset": data, "remote": remote_info, "systems": info, "workloads": WORKLOADS,
        "rows": runner.rows, "errors": runner.errors,
        "page_cache_dropped": bool(runner.dropped),
        "host_cache_warmed": runner.warm_host_cache,
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(), "platform": platform.platform()},
        "wall_s": time.monotonic() - t0,
    }


def _version(module: str) -> str:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:
        return "?"


def _save_alone(args: argparse.Namespace, name: str, text: str, t0: float,
                note: str = "") -> None:
    """Print a stand-alone workload's table and save it beside the other results."""
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    path = os.path.join(args.out, f"{stem}-{name}-{args.size}.md")
    with open(path, "w") as f:
        f.write(f"commit {_project_version()}, {os.cpu_count()} CPUs, {note}"
                f"{time.monotonic() - t0:.0f} s\n\n```\n{text}\n```\n")
    print(f"results: {path}")


def run_capacity(args: argparse.Namespace) -> int:
    """Workload `capacity` (bench/capacity.py): one daemon of ours per
    scenario, no remote, then the same scenarios on the engine in-process at
    a realistic scale (bench/policy_sim.py); prints each hit ratio beside
    its optimum and saves both tables beside the other results. 0 if every
    target is met."""
    scale = capacity.SCALES[args.size]
    log.info("workload capacity: cache of %d blocks of %d bytes", scale.blocks, scale.block_bytes)
    t0 = time.monotonic()
    os.makedirs(args.workdir, exist_ok=True)
    results = capacity.run_all(scale, capacity.on_daemon(args.workdir))
    log.info("workload capacity: in-process at %d blocks", policy_sim.BENCH_SCALE)
    at_scale = policy_sim.run(policy_sim.BENCH_SCALE, list(policy_sim.SCENARIOS))
    text = (f"real blockcached, {scale.blocks} blocks of {scale.block_bytes} bytes\n"
            f"{capacity.table(results)}\n\n{policy_sim.HEADING}\n"
            f"{policy_sim.table({policy_sim.BENCH_SCALE: at_scale})}")
    _save_alone(args, "capacity", text, t0)
    return 0 if all(r.met for r in results + at_scale) else 1


def run_cluster(args: argparse.Namespace) -> int:
    """Workload `cluster` (bench/cluster.py): 4 hosts and 3 memcached servers
    over the delayed remote; prints its ratios and saves the table beside the
    other results. 0 if every target is met."""
    t0 = time.monotonic()
    os.makedirs(args.workdir, exist_ok=True)
    targets = cluster.run_all(args.size, args.rtt_ms, args.workdir)
    _save_alone(args, "cluster", cluster.table(targets), t0, f"remote {args.rtt_ms:g} ms, ")
    return 0 if all(t.met for t in targets) else 1


def run_prefetch(args: argparse.Namespace) -> int:
    """Workload `prefetch` (bench/prefetch.py): 3,000 files read cold with and
    without `prefetch_ahead` (300 with `--size tiny`). 0 if every target is met."""
    files = 300 if args.size == "tiny" else prefetch.DEFAULT_FILES
    log.info("workload prefetch: %d files, cold, with and without prefetch_ahead", files)
    return prefetch.main(["--files", str(files), "--out", args.out])


def run_fio(args: argparse.Namespace) -> int:
    """Workload `fio` (bench/fio.py): fio's 4 KiB random and 1 MiB sequential
    reads on fresh fsclient mounts over a warm cache, against the passthrough
    (a 128 MiB file, 1 round, with `--size tiny`). 0 if both targets are met."""
    tiny = args.size == "tiny"
    log.info("workload fio: fsclient against the pyfuse3 passthrough")
    return fio.main(["--out", args.out] + (["--mib", "128", "--rounds", "1"] if tiny else []))


def run_restarts(args: argparse.Namespace) -> int:
    """Workload `restarts` (bench/restarts.py): a verifying reader across server
    kills and live restarts, against the same reader undisturbed. 0 if no read
    failed or was wrong and the longest stall was within the target."""
    log.info("workload restarts: reads across fsclient server kills and live restarts")
    return restarts.main(["--out", args.out] + (["--kills", "3", "--restarts", "2"]
                                                if args.size == "tiny" else []))


def run_checkpoint(args: argparse.Namespace) -> int:
    """Workload `checkpoint` (bench/checkpoint.py): a 1 GiB zip saved through a
    writable mount against the CRT client and s3fs uploading the same bytes,
    then loaded through fresh mounts (64 MiB, 1 round, with `--size tiny`).
    0 if every target is met."""
    log.info("workload checkpoint: writes through a writable mount to loopback S3")
    return checkpoint.main(["--out", args.out] + (["--mib", "64", "--rounds", "1"]
                                                  if args.size == "tiny" else []))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    args = parse_args(argv)
    _ensure_matplotlib()
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        stem = os.path.splitext(os.path.basename(args.from_json))[0]
    else:
        own_ok = True
        for name, run_own in (("capacity", run_capacity), ("prefetch", run_prefetch),
                              ("cluster", run_cluster), ("fio", run_fio),
                              ("restarts", run_restarts), ("checkpoint", run_checkpoint)):
            if not args.workloads or name in args.workloads:
                own_ok &= run_own(args) == 0
                if args.workloads:
                    args.workloads.remove(name)
                    if not args.workloads:
                        return 0 if own_ok else 1
        result = run(args)
        stem = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        if args.workloads or set(args.systems) != {s.name for s in all_systems()}:
            # A partial run never overwrites the day's full one.
            stem += "-partial-" + "-".join(args.workloads or ["all"])
    paths = report.write(result, args.out, stem)
    if args.publish:
        report.publish(paths, os.path.join(PROJECT_ROOT, "docs"))
    for t in result["targets"]:
        ratio = "not measured" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        print(f"{'MET ' if t['met'] else 'MISS' if t['met'] is False else '----'} "
              f"{t['target']} [{t['config']}]: {ratio}")
    print(f"results: {paths['json']}\ntables:  {paths['md']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
