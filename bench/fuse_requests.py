"""Warm small files through one fsclient mount: what each file costs its server.

    python -m bench.fuse_requests --readers 4 --rounds 3
    python -m bench.fuse_requests --fsclient ../old/.venv/bin/fsclient   # another build

The small-files workload's data and flow (`python -m bench small-files`): a
fresh mount, the class directories listed, one cold epoch, then `--rounds`
warm epochs of the shuffled files, each read `--repeat` times over, by
`--readers` processes of one mount. Per epoch:
- files/s;
- the FUSE requests per file by opcode, as the kernel sent them (its
  `fuse:fuse_request_send` tracepoint in a tracefs instance of our own,
  filtered on the mount's connection: root only);
- the CPU per file of the mount's process tree (keeper, server, its page-cache
  storer; the daemon's is not counted) and its context switches per file.

`--fsclient` mounts with another build's `fsclient` (a worktree's
`.venv/bin/fsclient`): both builds are then counted by the same tracepoint and
clock, from the same bench. Run it under the bench lock.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from . import datasets
from .remote import Remote
from .systems import (
    Ctx,
    FuseSystem,
    MountProcess,
    drop_page_cache,
    read_into_page_cache,
    stat_cpu,
)
from .worker import Workers

TRACEFS = "/sys/kernel/tracing"
INSTANCE = os.path.join(TRACEFS, "instances", "bench-fuse-requests")
EVENT = os.path.join(INSTANCE, "events", "fuse", "fuse_request_send")


class RequestTrace:
    """The FUSE requests the kernel sends to one connection, counted by opcode."""

    def __init__(self, minor: int):
        if not os.path.isdir(os.path.join(TRACEFS, "events")):
            os.makedirs(TRACEFS, exist_ok=True)
            if os.system(f"mount -t tracefs nodev {TRACEFS}"):
                raise RuntimeError(f"cannot mount tracefs on {TRACEFS} (root only)")
        os.makedirs(INSTANCE, exist_ok=True)
        if not os.path.isdir(EVENT):
            raise RuntimeError("this kernel has no fuse:fuse_request_send tracepoint (6.13+)")
        _write(os.path.join(INSTANCE, "buffer_size_kb"), "16384")
        _write(os.path.join(EVENT, "filter"), f"connection == {minor}")

    def start(self) -> None:
        _write(os.path.join(INSTANCE, "trace"), "")
        _write(os.path.join(EVENT, "enable"), "1")

    def stop(self) -> collections.Counter:
        _write(os.path.join(EVENT, "enable"), "0")
        counts: collections.Counter = collections.Counter()
        with open(os.path.join(INSTANCE, "trace")) as f:
            for line in f:
                if "(FUSE_" in line:
                    counts[line.split("(FUSE_", 1)[1].split(")", 1)[0]] += 1
        return counts

    @staticmethod
    def close() -> None:
        try:
            os.rmdir(INSTANCE)
        except OSError:
            pass


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it."""
    children = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    children[int(f.read().rsplit(")", 1)[1].split()[1])].append(int(name))
            except (OSError, IndexError):
                pass
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cpu_and_switches(pids: list[int]) -> tuple[float, int]:
    """CPU seconds of the processes (exited threads included) and the context
    switches of their live threads."""
    cpu, switches = 0.0, 0
    for pid in pids:
        try:
            cpu += stat_cpu(f"/proc/{pid}/stat") or 0.0
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    switches += sum(int(line.split()[1]) for line in f
                                    if "ctxt_switches" in line)
        except OSError:
            pass
    return cpu, switches


class BuildFuse(FuseSystem):
    """fsclient as this bench mounts it, with the `fsclient` of a build given."""

    def __init__(self, exe: str | None):
        super().__init__()
        self.exe = exe

    def _mount(self, client: int) -> MountProcess:
        m = super()._mount(client)
        if self.exe:
            m.argv[0] = self.exe
            # its keeper starts the server by `python -m`, which would put our
            # working directory (this tree) first on its path: not this build
            m.env = dict(os.environ, PYTHONSAFEPATH="1")
        return m


def measure(ctx: Ctx, readers: int, rounds: int, repeat: int, fsclient: str | None = None,
            timeout: float = 300.0, report=print, drop_caches: bool = True) -> list[dict]:
    """One mount over `ctx`'s small files: a cold epoch and `rounds` warm
    ones; a row per epoch (see the module's docstring). `drop_caches`: drop
    the host's caches before the cold epoch (not beside other mounts' tests:
    their kernels' nodes would be forgotten too)."""
    files = datasets.small_files(ctx.size)
    rows = []
    system = BuildFuse(fsclient)
    system.start(ctx, f"requests{readers}")
    trace = None
    try:
        mount = system.mounts[0]
        trace = RequestTrace(os.minor(os.stat(mount.mountpoint).st_dev))
        with Workers(system.reader_spec(0), readers, timeout=timeout) as workers:
            if drop_caches:
                drop_page_cache()
            workers.run_all("list", datasets.small_dirs(ctx.size))
            for epoch in range(1, rounds + 2):
                order = datasets.shuffled(files, epoch)
                if epoch > 1:
                    order *= repeat
                    read_into_page_cache(system.backing_dirs())
                pids = process_tree(mount.proc.pid)
                cpu0, sw0 = cpu_and_switches(pids)
                load = os.getloadavg()[0]
                trace.start()
                wall, answers = workers.run("files", [order[i::readers] for i in range(readers)])
                counts = trace.stop()
                cpu1, sw1 = cpu_and_switches(pids)
                n = sum(a["items"] for a in answers)
                rows.append({
                    "epoch": epoch, "phase": "cold" if epoch == 1 else "warm", "files": n,
                    "files_per_s": n / wall, "server_us_per_file": (cpu1 - cpu0) / n * 1e6,
                    "readers_us_per_file": sum(a["cpu"] for a in answers) / n * 1e6,
                    "server_switches_per_file": (sw1 - sw0) / n,
                    "requests_per_file": {op: c / n for op, c in sorted(counts.items())},
                    "load": load})
                report(_line(rows[-1]))
                system.settle()
    finally:
        if trace is not None:
            trace.close()
        system.stop()
    return rows


def _line(r: dict) -> str:
    reqs = " ".join(f"{op} {v:.2f}" for op, v in r["requests_per_file"].items() if v >= 0.005)
    return (f"epoch {r['epoch']} ({r['phase']}): {r['files_per_s']:8,.0f} files/s, server "
            f"{r['server_us_per_file']:6,.0f} us CPU and {r['server_switches_per_file']:.2f} "
            f"switches a file, readers {r['readers_us_per_file']:4,.0f} us; requests a file: "
            f"{reqs}; load {r['load']:.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fuse_requests",
                                description=__doc__.split("\n")[0])
    p.add_argument("--readers", type=int, default=4, help="reader processes of the one mount")
    p.add_argument("--rounds", type=int, default=3, help="warm epochs")
    p.add_argument("--repeat", type=int, default=3,
                   help="times each warm epoch reads the shuffled files (longer epochs)")
    p.add_argument("--size", default="default", choices=sorted(datasets.SIZES))
    p.add_argument("--fsclient", help="the fsclient executable to mount with (default: "
                   "this interpreter's)")
    p.add_argument("--workdir", default="/tmp/blockcache-bench-requests")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    size = datasets.SIZES[args.size]
    os.makedirs(args.workdir, exist_ok=True)
    local_root = os.path.join(args.workdir, f"local-{size.name}")
    with Remote(log_path=os.path.join(args.workdir, "moto.log")) as remote:
        datasets.upload(size, remote, local_root)
        rows = measure(Ctx(remote, local_root, args.workdir, size), args.readers, args.rounds,
                       args.repeat, args.fsclient, args.timeout,
                       report=lambda line: print(line, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
