"""`python -m bench.large_files`: large files and cold reads against AWS's CRT client, one run.

    python -m bench.large_files                      # the defaults below (~9 min on 2 cores)
    python -m bench.large_files --model-mib 0        # without the model-loading workload
    python -m bench.large_files --rounds 0 --model-rounds 5   # the model-loading workload alone
    BENCH_PROFILE=/tmp/prof python -m bench.large_files --model-mib 0   # + cProfile per command

One moto S3 server on 127.0.0.1 for every system, no delay added, its
ranged GETs copying only their range (`bench.moto_ranges`); each system
starts with empty caches in a dir of its own, and every system's dirs are
removed at the end, not as it stops (see `systems.retire`: removing them
at once charged the next system the file system's work); readers are
spawned processes (`bench.worker`).

1. cold small files: `--small-files` files of `--small-kib` KiB read whole,
   in order, by one reader: `Volume`, the CRT client, s3fs; `--rounds`
   times, each round in the other order, a system's best round counting.
2. cold large files: `--large-files` files of `--large-mib` MiB read front to
   back in 1 MiB reads, by the same systems.
3. warm large files through `Volume`: a new `Volume` (a new process) reads
   them again from the host cache, `--repeat` times, each beside the
   machine's AES-256-GCM decrypt rate on 64 KiB chunks (Volume's) with one
   thread and with as many threads as cores, measured just before with
   `cryptography`, the library the reader decrypts with: the limit our
   decryption sets. Read twice, each by a new `Volume`: with `readinto`
   into one 1 MiB buffer (how a loader that owns its buffer reads, and
   what the target counts), then with `read` (a new `bytes` per read: one
   more copy of every byte). The local copy read from the page cache is
   printed beside.
4. model loading (`bench.model_runs`): a safetensors checkpoint of about
   `--model-mib` MiB loaded by mmap from local disk (page cache dropped),
   through a fresh FUSE mount cold and warm, and by N readers at once on
   two mounts, cold; read then loaded by `Volume` and after the CRT
   client's GET; `--model-rounds` times, ratios within each round.

Each cold and warm row gives the reader process's CPU seconds, and for the
cold ones the moto server's (`S3 s`: the same server for every system) and
the daemon's (`daemon`: writing the cache files of what `Volume` read) in
the same epoch, with the 1-minute load average after it: on a shared
machine the CPU per item is the figure to compare, wall time swings. Under
each cold row, that CPU in ms a file or a MiB, split by the reader's
threads (by name: the reading thread `MainThread`, `blockcache-filler`
sealing and putting fills, `blockcache-prefetch` receiving a window's
parts, the CRT client's event loop as `other`) and the daemon's (its event
loop, and its workers writing the cache files).

Prints every figure and the ratios (the model's: medians over the rounds,
with their spread); writes them to
`<out>/<date>-large-files.json`. Exit status 0 when every target is met.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import sys
import threading
import time
import urllib.request

from devtools.s3server import S3Server

from . import PROJECT_ROOT, model_load, model_runs, moto_ranges
from .datasets import MIB, expected_bytes
from .remote import ACCESS_KEY, REGION, SECRET_KEY
from .systems import (
    CrtSystem,
    Ctx,
    LocalSystem,
    S3fsDirect,
    System,
    VolumeSystem,
    proc_cpu,
    read_into_page_cache,
    retire,
    settle,
    thread_cpu,
)
from .worker import Workers

log = logging.getLogger("bench.large_files")

COLD_SYSTEMS = ("volume", "crt", "s3fs")
# the targets (docs/benchmarks.md): name, figure, bound, True if the figure
# must be at most the bound
TARGETS = [
    ("warm 1 MiB sequential via Volume readinto >= 0.8x parallel decrypt", "warm_vs_decrypt",
     0.8, False),
    ("cold small files: Volume >= 1.0x crt", "small_vs_crt", 1.0, False),
    ("cold large files: Volume >= 1.0x crt", "large_vs_crt", 1.0, False),
    *model_runs.TARGETS,
]


class DirectRemote:
    """The one S3 server every system reads, as `systems.Ctx` wants a remote."""

    def __init__(self, workdir: str):
        self.bucket = "bench"
        self.moto = S3Server(self.bucket, module="bench.moto_ranges",
                             env={"PYTHONPATH": PROJECT_ROOT,
                                  "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(4 << 30)},
                             log_path=os.path.join(workdir, "moto.log"))

    @property
    def endpoint(self) -> str:
        return self.moto.endpoint_url

    def counters(self) -> dict:
        """GETs the server answered and the bytes they sent (`moto_ranges`)."""
        url = self.endpoint + moto_ranges.COUNTERS_PATH
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.loads(reply.read())

    def storage_options(self, direct: bool = False) -> dict:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": self.endpoint,
                "client_kwargs": {"region_name": REGION}}

    def __enter__(self) -> DirectRemote:
        self.moto.start()
        return self

    def __exit__(self, *exc) -> None:
        self.moto.stop()


def upload(remote: DirectRemote, local_root: str, args: argparse.Namespace) -> dict:
    """Put the data on the remote and in the local copy; returns the paths of each set."""
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **remote.storage_options())
    sets = {"small": [(f"small/f{i:05d}.bin", args.small_kib << 10)
                      for i in range(args.small_files)],
            "large": [(f"large/shard-{i}.bin", args.large_mib * MIB)
                      for i in range(args.large_files)]}
    for items in sets.values():
        for path, size in items:
            local = os.path.join(local_root, path)
            if not os.path.exists(local) or os.path.getsize(local) != size:
                os.makedirs(os.path.dirname(local), exist_ok=True)
                with open(local, "wb") as f:
                    f.write(expected_bytes(path, size))
            fs.put_file(local, f"{remote.bucket}/{path}")
    for path, _ in sets["large"]:
        _prime(fs, f"{remote.bucket}/{path}")
    out = {name: [p for p, _ in items] for name, items in sets.items()}
    if args.model_mib:
        local = os.path.join(local_root, model_load.MODEL_PATH)
        out["tensors"] = model_load.make(local, args.model_mib * MIB)
        fs.put_file(local, f"{remote.bucket}/{model_load.MODEL_PATH}")
        _prime(fs, f"{remote.bucket}/{model_load.MODEL_PATH}")
        out["model_bytes"] = os.path.getsize(local)
    return out


def _prime(fs, path: str) -> None:
    """One byte of a large object read once, before anything is measured:
    the server reads the whole object out of its buffer at its first GET
    (`moto_ranges`; 0.3 s for 512 MiB), a cost of the test server that
    would fall on whichever system read the object first."""
    fs.cat_file(path, start=0, end=1)


def decrypt_loops(threads: int, seconds: float, cipher=None, body=None) -> tuple[float, float]:
    """`threads` threads at once decrypting a 1 MiB block of Volume's 64 KiB
    chunks into a reused buffer with `cryptography` for `seconds`: (bytes/s
    of them all, each thread's CPU seconds a MiB on average). `cipher` and
    `body` (its sealed chunks): a fresh block's if not given."""
    from blockcache_client.contract import blockfile
    if cipher is None:
        vk = os.urandom(32)
        blob = memoryview(bytearray(blockfile.seal("k", os.urandom(MIB), vk)))
        cipher = blockfile.BlockCipher.from_head(blob[:blockfile.HEADER_SIZE], "k", vk,
                                                 blockfile.key_id(vk))
        body = blob[blockfile.HEADER_SIZE:]
    done = [0] * threads
    cpu = [0.0] * threads
    start = threading.Barrier(threads + 1)
    stop_at = [0.0]

    def work(i: int) -> None:
        out = memoryview(bytearray(MIB))
        start.wait()
        n, c0 = 0, time.thread_time()
        while time.perf_counter() < stop_at[0]:
            cipher.read_range_into(0, body, out)
            n += 1
        done[i], cpu[i] = n, (time.thread_time() - c0) / max(1, n)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    t0 = time.perf_counter()
    stop_at[0] = t0 + seconds
    start.wait()
    for t in pool:
        t.join()
    return sum(done) * MIB / (time.perf_counter() - t0), sum(cpu) / threads


def decrypt_rate(threads: int, seconds: float = 0.4) -> float:
    """Bytes/s a 1 MiB block of Volume's 64 KiB chunks decrypts into a reused
    buffer with `cryptography`, on `threads` threads at once."""
    return decrypt_loops(threads, seconds)[0]


def machine_decrypt(cores: int) -> dict:
    """The decrypt rates of one measurement: on 1 thread and on `cores`
    (`parallel`, the limit a reader may reach)."""
    return {"case": "decrypt", "threads": cores,
            "one_thread": decrypt_rate(1), "parallel": decrypt_rate(cores)}


def _epoch(workers: Workers, cmd: str, arg, label: str, rows: list,
           servers: dict[str, list[int]] | None = None, **extra) -> dict:
    """One command on the reader; `servers`: the processes whose CPU during
    it is reported beside the reader's ("s3": the moto server, "daemon")."""
    servers = servers or {}
    cpu0 = {k: sum(map(proc_cpu, pids)) for k, pids in servers.items()}
    daemon0 = _daemon_threads(servers.get("daemon", []))
    wall, [answer] = workers.run_all(cmd, arg)
    row = {"case": label, "seconds": wall, "bytes": answer["bytes"], "items": answer["items"],
           "mb_per_s": answer["bytes"] / wall / 1e6, "items_per_s": answer["items"] / wall,
           "cpu_s": answer["cpu"], "threads": answer.get("threads", {}),
           "load_avg": os.getloadavg()[0], **extra}
    for k, pids in servers.items():
        row[f"{k}_cpu_s"] = sum(map(proc_cpu, pids)) - cpu0[k]
    if servers.get("daemon"):
        row["daemon_threads"] = {k: v - daemon0.get(k, 0.0)
                                 for k, v in _daemon_threads(servers["daemon"]).items()}
    rows.append(row)
    log.info("%-34s %8.1f MB/s %9.1f items/s  %.2f s  cpu %.2f s%s", label, row["mb_per_s"],
             row["items_per_s"], wall, row["cpu_s"],
             "".join(f", {k} {row[f'{k}_cpu_s']:.2f} s" for k in servers))
    return row


def _daemon_threads(pids: list[int]) -> dict[str, float]:
    """The daemons' CPU seconds: the event loop's (each one's main thread)
    and their other threads' (the dir workers that write the cache files)."""
    out = {"loop": 0.0, "workers": 0.0}
    for pid in pids:
        for tid, cpu in thread_cpu(pid).items():
            out["loop" if tid == pid else "workers"] += cpu
    return out


def per_item(row: dict) -> str:
    """Where a cold row's CPU went, in ms a file (small files) or a MiB
    (the rest): the reader's threads by name, the daemon's loop and
    workers, the S3 server."""
    n = row["items"] if row.get("set") == "small" else row["bytes"] / MIB
    unit = "file" if row.get("set") == "small" else "MiB"
    if not n:
        return ""
    parts = [f"{k} {v / n * 1e3:.2f}" for k, v in
             sorted(row.get("threads", {}).items(), key=lambda kv: -kv[1])]
    ended = row["cpu_s"] - sum(row.get("threads", {}).values())
    if ended > 0.005:
        parts.append(f"ended threads {ended / n * 1e3:.2f}")
    text = f"  ms CPU a {unit}: reader {row['cpu_s'] / n * 1e3:.2f} ({', '.join(parts)})"
    if "daemon_threads" in row:
        d = row["daemon_threads"]
        text += (f"; daemon {row['daemon_cpu_s'] / n * 1e3:.2f} (loop "
                 f"{d['loop'] / n * 1e3:.2f}, workers {d['workers'] / n * 1e3:.2f})")
    if row.get("s3_cpu_s") is not None:
        text += f"; S3 {row['s3_cpu_s'] / n * 1e3:.2f}"
    return text


def _reader_stats(workers: Workers) -> dict:
    _, [answer] = workers.run_all("stats", None)
    return answer["stats"]


def _fills(system: System, workers: Workers, settle_cpu: float) -> dict:
    """What became of the cold epochs' fills, once settled: the reader's
    sent and dropped, the daemon's written and refused (a fill that never
    lands is a miss in the next epoch), and the daemon's CPU seconds spent
    settling, after the epochs (writes still queued when the reader ended)."""
    reader = _reader_stats(workers)
    daemon = system.daemon.stats()
    refused = {k: v for k, v in daemon.get("put_results", {}).items()
               if k not in ("queued", "exists", "duplicate")}
    row = {"case": "fills", "system": system.name, "sent": reader["fills_sent"],
           "dropped": reader["fills_dropped"], "written": daemon["writes"],
           "write_errors": daemon["write_errors"], "refused": refused,
           "entries": daemon["entries"], "settle_cpu_s": settle_cpu,
           "by_slot": daemon.get("fill_areas", {}).get("puts", 0)}
    log.info(_fills_line(row))
    return row


def _fills_line(r: dict) -> str:
    return (f"fills: reader sent {r['sent']} ({r.get('by_slot', 0)} from a fill area slot), "
            f"dropped {r['dropped']} (with the refused); daemon wrote {r['written']} "
            f"({r['write_errors']} errors), refused {r['refused'] or 'none'}; "
            f"{r['settle_cpu_s']:.2f} s of its CPU after the epochs")


def cold_and_warm(ctx: Ctx, system: System, data: dict, args, rows: list,
                  spent: list[str], tag: str = "files") -> None:
    """Workloads 1-3 on one system."""
    system.start(ctx, tag)
    try:
        servers = {"s3": [ctx.remote.moto.proc.pid], "daemon": system.server_pids()}
        with Workers(system.reader_spec(), 1) as w:
            _epoch(w, "files", data["small"], f"cold small files {system.name}", rows,
                   servers, system=system.name, phase="cold", set="small")
            _epoch(w, "seq", data["large"], f"cold large files {system.name}", rows,
                   servers, system=system.name, phase="cold", set="large")
            if system.name == "volume":
                cpu0 = sum(map(proc_cpu, system.server_pids()))
                settle(system, w)
                rows.append(_fills(system, w, sum(map(proc_cpu, system.server_pids())) - cpu0))
        if system.name != "volume":
            return
        cores = os.cpu_count() or 1
        for rep in range(args.repeat):
            rates = dict(machine_decrypt(cores), rep=rep)
            rows.append(rates)
            many = rates["parallel"]
            log.info("decrypt 64 KiB chunks: 1 thread %.2f GB/s, %d threads %.2f GB/s",
                     rates["one_thread"] / 1e9, cores, many / 1e9)
            for cmd, label in (("seqinto", " readinto"), ("seq", " read()")):
                read_into_page_cache(system.cache_dirs())
                with Workers(system.reader_spec(), 1) as w:  # a new Volume
                    row = _epoch(w, cmd, data["large"], f"warm large files volume{label}",
                                 rows, system="volume", phase="warm", set="large", rep=rep,
                                 decrypt=many, call=cmd)
                    row["misses"] = _reader_stats(w)["misses"]
    finally:
        retire(system, spent)
    local = LocalSystem()
    local.start(ctx, tag)
    try:
        read_into_page_cache([os.path.join(ctx.local_root, "large")])
        with Workers(local.reader_spec(), 1) as w:
            _epoch(w, "seq", data["large"], "page cache large files local", rows,
                   system="local", phase="warm", set="large")
    finally:
        retire(local, spent)


def _best(rows: list, key: str, **match) -> float | None:
    got = [r[key] for r in rows if all(r.get(k) == v for k, v in match.items())]
    return max(got) if got else None


def ratios(rows: list) -> dict:
    """The figures the targets compare (the model's: medians over its rounds)."""
    def ratio(a, b):
        return a / b if a and b else None
    out = {}
    # each warm read against the decrypt rate measured just before it:
    # readinto (the target), and read() beside it
    for key, case in (("warm_vs_decrypt", "warm large files volume readinto"),
                      ("warm read() vs decrypt", "warm large files volume read()")):
        out[key] = max((r["bytes"] / r["seconds"] / r["decrypt"] for r in rows
                        if r["case"] == case), default=None)
    for s in ("small", "large"):
        rate = "items_per_s" if s == "small" else "mb_per_s"
        out[f"{s}_vs_crt"] = ratio(_best(rows, rate, system="volume", phase="cold", set=s),
                                   _best(rows, rate, system="crt", phase="cold", set=s))
    out.update(model_runs.ratios(rows)[0])
    return {k: v for k, v in out.items() if v is not None}  # (workloads not run: none)


def met(value: float | None, want: float, at_most: bool) -> bool:
    """A target's figure is within its bound."""
    return value is not None and (value <= want if at_most else value >= want)


def report(rows: list, figures: dict) -> str:
    lines = [f"{'case':36} {'GB/s':>7} {'items/s':>9} {'s':>7} {'CPU s':>6} {'S3 s':>6} "
             f"{'daemon':>6} {'load':>5}"]
    for r in rows:
        if r.get("set") == "model":  # (their own table, below)
            continue
        if r["case"] == "fills":
            lines.append("  " + _fills_line(r))
            continue
        if r["case"] == "decrypt":
            lines.append(f"{'decrypt, 1 thread':36} {r['one_thread'] / 1e9:7.3f}")
            many = f"decrypt, {r['threads']} threads"
            lines.append(f"{many:36} {r['parallel'] / 1e9:7.3f}")
            continue
        extra = "".join(f" {'-' if r.get(k) is None else format(r[k], '6.2f'):>6}"
                        for k in ("s3_cpu_s", "daemon_cpu_s"))
        lines.append(f"{r['case']:36} {r['mb_per_s'] / 1e3:7.3f} {r['items_per_s']:9.1f} "
                     f"{r['seconds']:7.2f} {r['cpu_s']:6.2f}{extra} {r['load_avg']:5.2f}")
        if r.get("phase") == "cold" and r.get("set") in ("small", "large"):
            lines.append(per_item(r))
        if r.get("misses") is not None:
            lines.append(f"  misses (blocks not in the cache): {r['misses']}")
    lines.append("")
    spread = model_runs.ratios(rows)[1]
    for name, v in figures.items():
        if name not in spread:
            lines.append(f"{name:44} {v:.2f}x")
    if spread:
        lines += ["", *model_runs.report(rows, spread)]
    lines.append("")
    for name, key, want, at_most in TARGETS:
        v = figures.get(key)
        verdict = "----" if v is None else "MET " if met(v, want, at_most) else "MISS"
        lines.append(f"{verdict} {name}: {'not measured' if v is None else f'{v:.2f}x'}"
                     f"{model_runs.bound_note(key, figures)}")
    return "\n".join(lines)


def checked(args: argparse.Namespace) -> list[tuple]:
    """The targets of the workloads this run was asked for."""
    model = {key for _, key, _, _ in model_runs.TARGETS}
    ran_model = bool(args.model_mib and args.model_rounds)
    return [t for t in TARGETS if (ran_model if t[1] in model else args.rounds > 0)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.large_files",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small-files", type=int, default=300)
    p.add_argument("--small-kib", type=int, default=110)
    p.add_argument("--large-files", type=int, default=2)
    p.add_argument("--large-mib", type=int, default=192)
    p.add_argument("--model-mib", type=int, default=512,
                   help="the checkpoint's size (0: no model-loading workload; default "
                        "%(default)s)")
    p.add_argument("--model-rounds", type=int, default=3,
                   help="rounds of the model-loading workload; its figures are medians "
                        "(default %(default)s)")
    p.add_argument("--model-readers", default=",".join(map(str, model_runs.READERS)),
                   help="readers at once on 2 mounts, cold: one load of each count "
                        "(default %(default)s)")
    p.add_argument("--repeat", type=int, default=2,
                   help="warm Volume epochs per round (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of the cold workloads, each in the other order; every "
                        "figure takes a system's best round (default %(default)s; 0: the "
                        "model-loading workload alone)")
    p.add_argument("--systems", default=",".join(COLD_SYSTEMS),
                   help="systems of the cold workloads (default %(default)s)")
    p.add_argument("--workdir", default="/tmp/blockcache-large-files")
    p.add_argument("--out", default=os.path.join(PROJECT_ROOT, "bench", "results"))
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    try:
        args.model_readers = [int(n) for n in args.model_readers.split(",") if n]
    except ValueError:
        p.error(f"--model-readers takes counts such as 4,8, not {args.model_readers!r}")
    if any(n < 2 for n in args.model_readers):
        p.error("--model-readers: each count must be 2 or more (half on each of 2 mounts)")
    for s in args.systems:
        if s not in COLD_SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(COLD_SYSTEMS)}")
    return args


def run(args: argparse.Namespace) -> dict:
    rows: list[dict] = []
    os.makedirs(args.workdir, exist_ok=True)
    local_root = os.path.join(args.workdir, "local")
    makers = {"volume": VolumeSystem, "crt": CrtSystem, "s3fs": S3fsDirect}
    spent: list[str] = []  # systems' dirs, removed at the end (see `systems.retire`)
    with DirectRemote(args.workdir) as remote:
        data = upload(remote, local_root, args)
        ctx = Ctx(remote, local_root, args.workdir, None)
        os.sync()  # the local copy's writeback must not fall on the first system's epochs
        try:
            for r in range(args.rounds):  # alternate the order: no system always goes first
                for name in args.systems if r % 2 == 0 else reversed(args.systems):
                    cold_and_warm(ctx, makers[name](), data, args, rows, spent, f"files{r}")
            if args.model_mib:
                model_runs.run(ctx, args.model_rounds, args.model_readers, rows, spent,
                               data["model_bytes"])
        finally:
            for path in spent:
                shutil.rmtree(path, ignore_errors=True)
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "args": {k: v for k, v in vars(args).items()}, "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(), "data": {k: v for k, v in data.items()
                                                  if not isinstance(v, list)},
            "rows": rows, "figures": ratios(rows)}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    args = parse_args(argv)
    result = run(args)
    print(report(result["rows"], result["figures"]))
    print(f"load average {result['load_avg'][0]:.2f} (1 min), {result['cpus']} CPUs")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
                        + "-large-files.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"results: {path}")
    figures = result["figures"]
    return 0 if all(met(figures.get(k), want, most) for _, k, want, most in checked(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
