"""Reader processes: `Workers` starts N of them for one system and drives them in lock step.

Each worker is a spawned process (not forked: s3fs/aiohttp event loops and
daemon connections do not survive a fork well, and a spawned worker starts as
a DataLoader worker with persistent_workers would) that builds its reader
from the system's spec and then runs one command at a time. The coordinator
sends a command to every worker at once and waits for all, so an epoch's wall
time covers the slowest worker. Workers stay up across epochs, so in-process
caches carry over as they would in training.

Every answer carries the worker's CPU seconds (user + system, children
included) spent on the command, the part of them each kind of thread
spent (`threads`, by thread name), its page faults (`faults`: minor and
major, those that waited for I/O, as a mapped load takes them), the bytes
it had read from a disk (`disk_bytes`: /proc's `read_bytes`, page faults'
included), and per-item latencies.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import multiprocessing
import os
import re
import resource
import sys
import threading
import time
import traceback

from .access_paths import import_all, make_reader
from .systems import thread_cpu

log = logging.getLogger(__name__)

READY_TIMEOUT = 120.0


def _cpu() -> float:
    """This process's CPU seconds (to the nanosecond: a small load's is a few
    ms, under /proc's 10 ms tick) and its waited-for children's."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def _faults() -> tuple[int, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_majflt


def _disk_bytes() -> int:
    """Bytes this process had the block layer read for it (0 where /proc says nothing)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _threads_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads, summed by thread name
    without its number (the four `blockcache-prefetch_N` as one)."""
    names = {t.native_id: re.sub(r"[-_]?\d+$", "", t.name) for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid, cpu in thread_cpu(os.getpid()).items():
        name = names.get(tid, "other")
        out[name] = out.get(name, 0.0) + cpu
    return out


def _run(reader, cmd: str, arg) -> dict:
    lat: list[float] = []
    nbytes = 0
    clock = time.perf_counter
    if cmd == "files":
        for path in arg:
            t0 = clock()
            nbytes += len(reader.read_file(path))
            lat.append(clock() - t0)
    elif cmd == "seq":
        for path in arg:
            t0 = clock()
            nbytes += reader.read_seq(path)
            lat.append(clock() - t0)
    elif cmd == "seqinto":
        for path in arg:
            t0 = clock()
            nbytes += reader.read_seq_into(path)
            lat.append(clock() - t0)
    elif cmd == "safetensors":
        # a model loaded as a user would: the file's bytes, then its tensors
        from safetensors.numpy import load
        tensors = 0
        for path in arg:
            t0 = clock()
            data = reader.read_file(path)
            tensors += len(load(data))
            nbytes += len(data)
            lat.append(clock() - t0)
        return {"lat": lat, "bytes": nbytes, "items": tensors}
    elif cmd == "mapped":
        # a model loaded from a path as serving code does: mapped, then each
        # tensor copied out (`model_load.load_mapped`)
        from .model_load import load_mapped
        tensors = 0
        for path in arg:
            t0 = clock()
            n, count = load_mapped(reader.path_of(path))
            nbytes += n
            tensors += count
            lat.append(clock() - t0)
        return {"lat": lat, "bytes": nbytes, "items": tensors}
    elif cmd == "ranges":
        for path, offset, size in arg:
            t0 = clock()
            nbytes += len(reader.read_range(path, offset, size))
            lat.append(clock() - t0)
    elif cmd == "stat":
        for path in arg:
            t0 = clock()
            reader.stat(path)
            lat.append(clock() - t0)
    elif cmd == "list":
        for path in arg:
            t0 = clock()
            reader.listdir(path)
            lat.append(clock() - t0)
    elif cmd == "import":
        # One latency per run of the whole tree; items count the modules.
        root, modules = arg
        t0 = clock()
        n = import_all(reader, root, modules)
        return {"lat": [clock() - t0], "bytes": 0, "items": n}
    elif cmd == "digest":
        return {"digests": {p: hashlib.sha256(reader.read_file(p)).hexdigest() for p in arg}}
    elif cmd == "ranges_digest":
        return {"digests": [hashlib.sha256(reader.read_range(*r)).hexdigest() for r in arg]}
    elif cmd == "preload":
        # modules a later command imports, loaded before that command is timed
        for name in arg:
            importlib.import_module(name)
        return {}
    elif cmd == "stats":
        return {"stats": reader.stats()}
    elif cmd == "settle":
        reader.settle()
        return {}
    else:
        raise ValueError(f"unknown worker command {cmd!r}")
    return {"lat": lat, "bytes": nbytes, "items": len(lat)}


# BENCH_PROFILE=DIR: each worker writes a cProfile of every command it runs
# to DIR/<pid>-<n>-<cmd>.pstats (read with `python -m pstats FILE`), to see
# where one system's time goes inside the suite's own conditions.
_PROFILE_DIR = os.environ.get("BENCH_PROFILE")
_profiled_runs = [0]


def _profiled(reader, cmd: str, arg) -> dict:
    import cProfile
    prof = cProfile.Profile()
    try:
        return prof.runcall(_run, reader, cmd, arg)
    finally:
        _profiled_runs[0] += 1
        os.makedirs(_PROFILE_DIR, exist_ok=True)
        prof.dump_stats(os.path.join(_PROFILE_DIR,
                                     f"{os.getpid()}-{_profiled_runs[0]:03d}-{cmd}.pstats"))


def worker_main(conn, spec: dict) -> None:
    """A worker's life: build the reader, answer commands until `quit`."""
    sys.dont_write_bytecode = True   # every import epoch compiles, on every system alike
    logging.basicConfig(level=logging.WARNING)
    try:
        reader = make_reader(spec)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "quit":
                break
            c0, t0, f0, d0 = _cpu(), _threads_cpu(), _faults(), _disk_bytes()
            try:
                out = _profiled(reader, cmd, arg) if _PROFILE_DIR else _run(reader, cmd, arg)
            except BaseException:
                conn.send(("error", traceback.format_exc()))
                continue
            out["cpu"] = _cpu() - c0
            out["faults"] = [b - a for a, b in zip(f0, _faults())]
            out["disk_bytes"] = _disk_bytes() - d0
            # per thread: what of `cpu` each kind of thread spent (threads
            # that ended meanwhile show only in `cpu`)
            out["threads"] = {k: v - t0.get(k, 0.0) for k, v in _threads_cpu().items()
                              if v - t0.get(k, 0.0) > 0}
            conn.send(("ok", out))
    finally:
        reader.close()


class WorkerError(RuntimeError):
    """A worker failed a command or did not answer in time."""


class Workers:
    """N spawned reader processes for one reader spec, or one each for a
    list of specs (readers of several mounts)."""

    def __init__(self, spec: dict | list[dict], n: int = 1, timeout: float = 600.0):
        self.timeout = timeout
        ctx = multiprocessing.get_context("spawn")
        self.procs = []
        self.conns = []
        specs = spec if isinstance(spec, list) else [spec] * n
        try:
            for spec in specs:
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(child, spec), daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            for conn in self.conns:
                self._recv(conn, READY_TIMEOUT, "start")
        except BaseException:
            self.close()
            raise

    def _recv(self, conn, timeout: float, what: str):
        if not conn.poll(timeout):
            raise WorkerError(f"a reader process did not finish {what} within {timeout:.0f} s")
        try:
            status, value = conn.recv()
        except EOFError:
            raise WorkerError(f"a reader process died during {what}") from None
        if status == "error":
            raise WorkerError(f"a reader process failed {what}:\n{value}")
        return value

    def run(self, cmd: str, args: list) -> tuple[float, list[dict]]:
        """Send `args[i]` to worker i (all at once); returns wall seconds and the answers."""
        assert len(args) == len(self.conns)
        t0 = time.perf_counter()
        for conn, arg in zip(self.conns, args):
            conn.send((cmd, arg))
        answers = [self._recv(conn, self.timeout, cmd) for conn in self.conns]
        return time.perf_counter() - t0, answers

    def run_all(self, cmd: str, arg) -> tuple[float, list[dict]]:
        """The same argument to every worker."""
        return self.run(cmd, [arg] * len(self.conns))

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("quit", None))
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
