"""The model-loading workload of `python -m bench.large_files`: a checkpoint loaded by mmap.

`bench.model_load`'s safetensors checkpoint of `--model-mib` MiB, on the
S3 server the rest reads (`bench.moto_ranges`, which counts the bytes it
sends), loaded `--model-rounds` times over by spawned reader processes,
every system started empty:

1. local disk: mapped (`model_load.load_mapped`) with the file's page cache
   dropped first (`model_load.drop_file_cache`), then again with it in the
   page cache;
2. a fresh FUSE mount (fsclient + blockcached), mapped, cold; then its fills
   settled, the mount made again (the kernel's pages of the file and the
   server's memory gone), the cache files read into the host's page cache
   (as before every warm epoch: docs/benchmarks.md), mapped again: warm;
3. `Volume`, read then loaded (it has no path to map), cold, and warm by a
   new process;
4. AWS's CRT client: the object's GET, then loaded;
5. for each N of `--model-readers`: N processes at once, half on each of two
   mounts of the volume (one daemon, one cache, empty), mapped, cold; just
   before, its yardstick: N mapped loads at once from local disk, the file
   in the page cache (what N loaders cost this machine by themselves).

Every load is by a new process (a job's start: its tensors land in fresh
memory; a process that loaded before would reuse its heap), its loader's
modules imported before it is timed. Each row gives GB/s (the file's bytes
times the readers over the wall time), the readers' CPU, the servers' (each
mount's process tree and the daemon), the S3 server's, the whole machine's
busy CPU seconds over the load (`host`), the page faults the readers took
(major: those that waited for I/O), the bytes they had read from a disk,
and the bytes the S3 server sent over the file's size; then each load's
CPU in ms a MiB. Ratios are taken within each round; a figure is their
median over the rounds, its spread beside it. Some are not measurements
but the bounds this machine's cores put on a target (`BOUNDS`), from the
CPU each load spent in the same round: `cap`, the most the warm mapped
load could reach against local disk, given the CPU a MiB each side spent
(fsclient/DESIGN.md, "A mapped load: what a MiB costs"), and the cold one
against the CRT client, its CPU spread over every core; `floor`, the
least N readers' wall time could be against one reader's, all their CPU
spread over every core. A load's CPU there is its readers', servers' and
the S3 server's, or the machine's busy time where that is more (the
kernel's writeback of a cold load's fills is charged to no process).
"""

from __future__ import annotations

import logging
import os
import statistics

from . import model_load, systems
from .fuse_requests import cpu_and_switches, process_tree
from .systems import CrtSystem, Ctx, FuseSystem, LocalSystem, System, VolumeSystem
from .worker import Workers

log = logging.getLogger("bench.model_runs")

MIB = 1 << 20
MODEL_PATH = model_load.MODEL_PATH
READERS = (4, 8)
LOADER_MODULES = ["numpy", "safetensors", "safetensors.numpy"]
# name, figure, bound, True if the figure must be at most the bound (docs/benchmarks.md)
TARGETS = [
    ("warm mapped load via a fresh mount >= 0.9x local disk, page cache dropped",
     "model warm fuse vs local dropped", 0.9, False),
    ("cold mapped load via a fresh mount >= 1.5x crt GET + load",
     "model cold fuse vs crt", 1.5, False),
    *[target for n in READERS for target in (
        (f"{n} cold mapped loads on 2 mounts: remote bytes <= 1.05x the file",
         f"model x{n} remote vs file", 1.05, True),
        (f"{n} cold mapped loads on 2 mounts: wall time <= 1.3x one reader's",
         f"model x{n} wall vs one reader", 1.3, True))],
]
# figure -> (row, row) of one round whose MB/s it divides
_SPEED_RATIOS = {
    "model warm fuse vs local dropped": ("fuse warm", "local dropped"),
    "model cold fuse vs crt": ("fuse cold", "crt cold"),
    "model cold fuse vs local dropped": ("fuse cold", "local dropped"),
    "model warm fuse vs local cached": ("fuse warm", "local cached"),
    "model cold volume vs crt": ("volume cold", "crt cold"),
    "model warm volume vs local dropped": ("volume warm", "local dropped"),
}


def _servers_cpu(system: System) -> float:
    """CPU seconds of `system`'s servers: each mount's process tree (keeper,
    server, its page-cache storer) and the daemon."""
    pids = [p for root in system.server_pids() for p in process_tree(root)]
    return cpu_and_switches(pids)[0]


def _load(ctx: Ctx, system: System, workers: Workers, cmd: str, key: str, rows: list,
          file_bytes: int, rnd: int) -> dict:
    """One load by every worker at once, as row `key` of round `rnd`."""
    workers.run_all("preload", LOADER_MODULES)  # (the first load would time the imports)
    s3 = ctx.remote.moto.proc.pid
    cpu0, s30 = _servers_cpu(system), systems.proc_cpu(s3)
    sent0 = ctx.remote.counters()["bytes_out"]
    host0 = systems.host_cpu()
    wall, answers = workers.run_all(cmd, [MODEL_PATH])
    host = systems.host_cpu() - host0
    sent = ctx.remote.counters()["bytes_out"] - sent0
    row = {"case": f"model {key}", "key": key, "set": "model", "round": rnd,
           "system": system.name, "readers": len(answers), "seconds": wall,
           "file_bytes": file_bytes,
           "bytes": sum(a["bytes"] for a in answers), "items": sum(a["items"] for a in answers),
           # (the file's bytes, whether mapped or read: a mapped load counts its tensors')
           "mb_per_s": file_bytes * len(answers) / wall / 1e6,
           "cpu_s": sum(a["cpu"] for a in answers),
           "server_cpu_s": _servers_cpu(system) - cpu0, "s3_cpu_s": systems.proc_cpu(s3) - s30,
           "host_cpu_s": host,
           "remote_bytes": sent, "remote_vs_file": sent / file_bytes,
           "faults": [sum(a["faults"][i] for a in answers) for i in (0, 1)],
           "disk_bytes": sum(a["disk_bytes"] for a in answers),
           "load_avg": os.getloadavg()[0]}
    rows.append(row)
    log.info("%s", _line(row))
    return row


def local_disk(ctx: Ctx, rows: list, spent: list[str], file_bytes: int, rnd: int) -> None:
    """Workload 1: local disk, page cache dropped, then cached."""
    system = LocalSystem()
    system.start(ctx, f"model{rnd}")
    try:
        for key in ("local dropped", "local cached"):  # each by a new process, as every load
            with Workers(system.reader_spec()) as w:
                if key == "local dropped":
                    model_load.drop_file_cache(os.path.join(ctx.local_root, MODEL_PATH))
                _load(ctx, system, w, "mapped", key, rows, file_bytes, rnd)
    finally:
        systems.retire(system, spent)


def one_reader(ctx: Ctx, system: System, rows: list, spent: list[str], file_bytes: int,
               rnd: int) -> None:
    """Workloads 2-4 on one system: cold, then (a cache) warm in a new
    reader process, through a fresh mount."""
    system.start(ctx, f"model{rnd}")
    cmd = "mapped" if system.kind == "mount" else "safetensors"
    try:
        with Workers(system.reader_spec()) as w:
            _load(ctx, system, w, cmd, f"{system.name} cold", rows, file_bytes, rnd)
            if system.name == "crt":
                return
            systems.settle(system, w)
        if system.kind == "mount":
            system.restart_client(0)
        systems.read_into_page_cache(system.cache_dirs())
        with Workers(system.reader_spec()) as w:
            _load(ctx, system, w, cmd, f"{system.name} warm", rows, file_bytes, rnd)
    finally:
        systems.retire(system, spent)


def many_readers(ctx: Ctx, n: int, rows: list, spent: list[str], file_bytes: int,
                 rnd: int) -> None:
    """Workload 5: `n` cold mapped loads at once, half on each of two mounts."""
    system = FuseSystem()
    system.start(ctx, f"model{rnd}-x{n}")
    try:
        system.add_client()
        with Workers([system.reader_spec(i % 2) for i in range(n)]) as w:
            _load(ctx, system, w, "mapped", f"fuse cold x{n}", rows, file_bytes, rnd)
    finally:
        systems.retire(system, spent)


def many_local(ctx: Ctx, n: int, rows: list, spent: list[str], file_bytes: int,
               rnd: int) -> None:
    """The yardstick of workload 5: `n` mapped loads at once from local disk,
    the file in the page cache (what `n` loaders cost this machine with no
    remote, no mount and no cache: their copies into fresh memory)."""
    system = LocalSystem()
    system.start(ctx, f"model{rnd}-local-x{n}")
    try:
        with Workers([system.reader_spec()] * n) as w:
            systems.read_into_page_cache([os.path.join(ctx.local_root,
                                                       os.path.dirname(MODEL_PATH))])
            _load(ctx, system, w, "mapped", f"local cached x{n}", rows, file_bytes, rnd)
    finally:
        systems.retire(system, spent)


def run(ctx: Ctx, rounds: int, readers: list[int], rows: list, spent: list[str],
        file_bytes: int) -> None:
    """Every workload above, `rounds` times."""
    for rnd in range(rounds):
        local_disk(ctx, rows, spent, file_bytes, rnd)
        for system in (FuseSystem(), VolumeSystem(), CrtSystem()):
            why = system.unavailable()
            if why:
                log.warning("model loading: skipping %s: %s", system.name, why)
                continue
            one_reader(ctx, system, rows, spent, file_bytes, rnd)
        if FuseSystem().unavailable() is None:
            for n in readers:  # (each beside its yardstick: the same memory's state)
                many_local(ctx, n, rows, spent, file_bytes, rnd)
                many_readers(ctx, n, rows, spent, file_bytes, rnd)


def ratios(rows: list) -> tuple[dict, dict]:
    """(figures, spread): each figure's median over the rounds, and its
    values round by round."""
    by_round: dict[int, dict[str, dict]] = {}
    for r in rows:
        if r.get("set") == "model":
            by_round.setdefault(r["round"], {})[r["key"]] = r
    spread: dict[str, list[float]] = {}
    for got in by_round.values():
        values = {}
        for name, (a, b) in _SPEED_RATIOS.items():
            if a in got and b in got:
                values[name] = got[a]["mb_per_s"] / got[b]["mb_per_s"]
        cap = _cpu_cap(got)
        if cap is not None:
            values["model warm fuse cap vs local dropped"] = cap
        one, crt = got.get("fuse cold"), got.get("crt cold")
        if one is not None:
            values["model cold fuse remote vs file"] = one["remote_vs_file"]
            if crt is not None:
                values["model cold fuse cap vs crt"] = crt["seconds"] / _cpu_floor(one)
        local = got.get("local cached")
        for key, row in got.items():
            many = key.rsplit(" ", 1)[1]  # ("x8" in "fuse cold x8")
            if key.startswith("local cached x") and local is not None:
                values[f"model {many} local wall vs one local"] = row["seconds"] / local["seconds"]
            if key.startswith("fuse cold x"):  # N readers on 2 mounts
                values[f"model {many} remote vs file"] = row["remote_vs_file"]
                if one is not None:
                    values[f"model {many} wall vs one reader"] = row["seconds"] / one["seconds"]
                    values[f"model {many} wall floor vs one reader"] = (
                        _cpu_floor(row) / one["seconds"])
        for name, v in values.items():
            spread.setdefault(name, []).append(v)
    return {k: statistics.median(v) for k, v in spread.items()}, spread


def ms_a_mib(row: dict) -> tuple[float, float, float]:
    """A row's CPU in ms a MiB of the file, a reader's: the readers', the
    servers' (mounts and daemon), the S3 server's."""
    mib = row["file_bytes"] * row["readers"] / MIB
    return tuple(row[k] / mib * 1e3 for k in ("cpu_s", "server_cpu_s", "s3_cpu_s"))


def _cpu_cap(got: dict, cores: int | None = None) -> float | None:
    """The most a warm mapped load through the mount could reach against
    local disk (page cache dropped) on `cores` idle cores, from their CPU a
    MiB in this round: each MiB needs the reader's CPU on one core and the
    reader's and the server's together on all of them; local dropped needs
    only its reader's (this VM's disk is served from the host's memory)."""
    warm, local = got.get("fuse warm"), got.get("local dropped")
    if warm is None or local is None:
        return None
    cores = cores or os.cpu_count() or 1
    reader, server, _ = ms_a_mib(warm)
    slowest = max(reader, (reader + server) / cores)
    return ms_a_mib(local)[0] / slowest if slowest > 0 else None


def _cpu_floor(row: dict, cores: int | None = None) -> float:
    """The least wall time `row`'s load could take on `cores` idle cores:
    the CPU seconds it cost spread over all of them. Those are the
    machine's busy seconds over the load where they are more than the
    readers', servers' and S3 server's: a cold load's fills are also
    written back by the kernel's threads, which no process is charged."""
    cores = cores or os.cpu_count() or 1
    spent = row["cpu_s"] + row["server_cpu_s"] + row["s3_cpu_s"]
    return max(spent, row["host_cpu_s"]) / cores


# figure -> the bound this machine's cores put on it: (its figure, True if a
# floor, and for N readers the figure of as many loads from local disk)
BOUNDS = {"model warm fuse vs local dropped": ("model warm fuse cap vs local dropped", False,
                                               None),
          "model cold fuse vs crt": ("model cold fuse cap vs crt", False, None),
          **{f"model x{n} wall vs one reader": (f"model x{n} wall floor vs one reader", True,
                                                f"model x{n} local wall vs one local")
             for n in READERS}}


def bound_note(key: str, figures: dict) -> str:
    """What this machine's cores allow of figure `key` (`BOUNDS`), for its
    verdict line; "" where none is known."""
    bound, floor, yardstick = BOUNDS.get(key, (None, False, None))
    v = figures.get(bound)
    if v is None:
        return ""
    note = f"{os.cpu_count()} CPUs allow {'no less than' if floor else 'at most'} {v:.2f}x"
    local = figures.get(yardstick)
    if local is not None:
        note += f"; {yardstick.split()[1][1:]} loads from local disk: {local:.2f}x one"
    return f" ({note})"


HEADER = (f"{'model load':34} {'GB/s':>6} {'s':>6} {'CPU s':>6} {'server':>6} {'S3 s':>5} "
          f"{'host':>5} {'remote/file':>11} {'faults':>7} {'major':>6} {'disk MB':>7} "
          f"{'load':>5}")


def _line(r: dict) -> str:
    name = f"{r['key']} (round {r['round']})"
    return (f"{name:34} {r['mb_per_s'] / 1e3:6.3f} {r['seconds']:6.2f} {r['cpu_s']:6.2f} "
            f"{r['server_cpu_s']:6.2f} {r['s3_cpu_s']:5.2f} {r['host_cpu_s']:5.2f} "
            f"{r['remote_vs_file']:10.2f}x "
            f"{r['faults'][0]:7d} {r['faults'][1]:6d} {r['disk_bytes'] / 1e6:7.1f} "
            f"{r['load_avg']:5.2f}")


def report(rows: list, spread: dict) -> list[str]:
    """The model rows, the CPU of each kind of load in ms a MiB (medians
    over the rounds), then each figure's median and spread."""
    mine = [r for r in rows if r.get("set") == "model"]
    lines = [HEADER] + [_line(r) for r in mine] + ["", "ms CPU a MiB (medians): reader, "
                                                       "servers (mounts, daemon), S3 server"]
    for key in dict.fromkeys(r["key"] for r in mine):
        each = list(zip(*(ms_a_mib(r) for r in mine if r["key"] == key)))
        lines.append(f"  {key:16} " + ", ".join(f"{statistics.median(v):5.2f}" for v in each))
    lines.append("")
    for name, values in spread.items():
        lines.append(f"{name:44} {statistics.median(values):.2f}x "
                     f"({min(values):.2f}-{max(values):.2f} over {len(values)} rounds)")
    return lines
