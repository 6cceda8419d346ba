"""The five workloads, each run on every system in turn, producing result rows.

Every (workload, configuration, system) starts from a fresh system with empty
caches, runs epoch 1 (cold) and epoch 2 (warm; for workload 5 also a warm
epoch 3 of client 0 restarted and the first epoch of each further client),
and stops the system again, whatever happens.
A failure is recorded as an error row and the suite goes on.

1. small files: the ImageNet-like set, shuffled anew each epoch, split
   round-robin over 1 and N reader processes (a DataLoader's workers); up to
   `warm_epochs` warm epochs where they are short, whose median is the warm
   figure.
2. large sequential: every shard front to back in 1 MiB reads, two passes.
3. random reads: 4 KiB and 128 KiB reads at aligned random offsets in the
   shards (the same offsets both epochs), separately for each size.
4. metadata: `stat` of every small file; importing every module of the
   package tree (fresh `sys.modules` each epoch).
5. shared cache: one client reads a subset cold and warm; then, for
   `shared_rounds` rounds (one if the epochs are long), it is restarted (a new
   process, or remounted over its cache) beside new clients, and all read the
   subset in turns of a few ms. New clients are held to the restarted one:
   both start with no memory of their own, so they differ only in whether
   the cache they read is shared. Turns let the machine's changes of speed
   fall on all of them alike.

Each row: items and bytes, wall seconds, items/s and MB/s, p50/p99 latency per
item, CPU seconds of readers plus the system's server processes (and per GB
read), requests and bytes that crossed to the remote, the hit ratio where the
system reports hits and misses, and the bytes its cache dirs hold afterwards.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field

from . import datasets
from .systems import Ctx, System, disk_bytes, drop_page_cache, proc_cpu, read_into_page_cache
from .worker import Workers

log = logging.getLogger(__name__)

WORKLOADS = {
    "small-files": "1. small files (ImageNet-like), shuffled epochs: one cold, up to 3 warm",
    "large-seq": "2. large files, sequential, two passes",
    "random": "3. random reads inside large files",
    "metadata": "4. metadata: stat every file; import a package tree",
    "shared": "5. several clients sharing one cache",
}
# Systems that cache nothing have no cache to share (workload 5).
_NO_CACHE = {"s3fs", "crt", "local", "passthrough"}
# Workload 5: files a client reads in one turn before the next client's turn
# (a few ms warm: shorter than the CPU speed changes it evens out).
SHARED_SLICE = 100
# Workloads 1 and 5: epochs this long are measured once (extra warm epochs
# of workload 1, further rounds of workload 5 are for short ones).
LONG_EPOCH_S = 1.0


@dataclass
class Runner:
    """Runs workloads on systems and collects rows and errors."""
    ctx: Ctx
    drop_caches: bool = True
    warm_host_cache: bool = True
    timeout: float = 300.0
    rows: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    dropped: bool | None = None

    # --- plumbing ---

    def _drop_page_cache(self) -> None:
        """Before a cold epoch: so local and cached files come from disk, not memory."""
        if not self.drop_caches or self.dropped is False:
            return
        self.dropped = drop_page_cache()

    def _warm_backing_files(self, system: System) -> None:
        """Before a warm epoch: the host page cache holds the system's cache
        files (the local copy for local disk and the passthrough), for every
        system alike. A kernel that reclaims idle pages (DAMON) would otherwise
        start a system with a longer cold epoch partly from disk."""
        if self.warm_host_cache:
            read_into_page_cache(system.backing_dirs())

    def _measure(self, system: System, workers: Workers, cmd: str, args: list,
                 base: dict) -> dict:
        """One epoch of one group of workers: `args[i]` to worker i."""
        return self._measure_together(system, [_Run(workers, cmd, [args], base)])[0]

    def _measure_together(self, system: System, runs: list[_Run]) -> list[dict]:
        """One epoch of each run, their slices taken in turn (run 0's first
        slice, run 1's first, ..., then each run's second); one row per run.

        Each run's figures are its own: time, latencies and remote traffic are
        summed over its slices, hits come from its own workers' counters, and
        the server CPU of its slices is its own. Only the server CPU of the
        pause after the epoch (background fills landing) is split evenly."""
        if any(r.base["epoch"] > 1 or r.base["client"] > 0 for r in runs):
            self._warm_backing_files(system)
        pids = system.server_pids()
        for r in runs:
            r.stats0 = _merge_stats(r.workers.run_all("stats", None)[1])
        for i in range(max(len(r.slices) for r in runs)):
            for r in runs:
                if i < len(r.slices):
                    remote0 = self.ctx.remote.counters()
                    srv0 = sum(proc_cpu(pid) for pid in pids)
                    wall, answers = r.workers.run(r.cmd, r.slices[i])
                    srv1 = sum(proc_cpu(pid) for pid in pids)
                    remote1 = self.ctx.remote.counters()
                    r.wall += wall
                    r.answers += answers
                    r.srv_cpu += srv1 - srv0
                    r.requests += remote1["requests"] - remote0["requests"]
                    r.bytes_down += remote1["bytes_down"] - remote0["bytes_down"]
        for r in runs:
            r.stats1 = _merge_stats(r.workers.run_all("stats", None)[1])
        # A pause between epochs lets background fills land, in the readers
        # and then in the daemon; the next epoch should not race them. Their
        # CPU is the epoch's: it is counted, though not in the epoch's time.
        srv0 = sum(proc_cpu(pid) for pid in pids)
        for r in runs:
            r.answers += [dict(a, lat=[], items=0, bytes=0)
                          for a in r.workers.run_all("settle", None)[1]]
        system.settle()
        pause_cpu = (sum(proc_cpu(pid) for pid in pids) - srv0) / len(runs)
        cache_bytes = disk_bytes(system.cache_dirs())
        return [self._row(system, r, r.srv_cpu + pause_cpu, cache_bytes) for r in runs]

    def _row(self, system: System, run: _Run, srv_cpu: float, cache_bytes: int) -> dict:
        base, wall, answers = run.base, run.wall, run.answers
        lat = sorted(x for a in answers for x in a["lat"])
        items = sum(a["items"] for a in answers)
        nbytes = sum(a["bytes"] for a in answers)
        cpu = sum(a["cpu"] for a in answers) + srv_cpu
        row = dict(base, system=system.name, items=items, bytes=nbytes, seconds=wall,
                   items_per_s=items / wall if wall else None,
                   mb_per_s=nbytes / wall / 1e6 if wall else None,
                   p50_ms=_pct(lat, 0.50) * 1e3, p99_ms=_pct(lat, 0.99) * 1e3,
                   cpu_s=cpu, cpu_s_per_gb=cpu / (nbytes / 1e9) if nbytes else None,
                   remote_requests=run.requests, remote_bytes=run.bytes_down,
                   hit_ratio=_hit_ratio(run.stats0, run.stats1), cache_bytes=cache_bytes)
        log.info("%-12s %-14s %-10s epoch %d: %7.1f items/s %8.1f MB/s p50 %.2f ms p99 %.2f ms",
                 base["workload"], base["config"], system.name, base["epoch"],
                 row["items_per_s"] or 0, row["mb_per_s"] or 0, row["p50_ms"], row["p99_ms"])
        self.rows.append(row)
        return row

    def _epochs(self, system: System, n_readers: int, workload: str, parts: list,
                epochs: int = 2, client: int = 0, listing: list[str] | None = None,
                first_epoch: int = 1, more_warm: int = 0) -> None:
        """Start `n_readers` workers and run `epochs` epochs of every part,
        numbered from `first_epoch` (epoch 1 is cold, later ones warm), then
        up to `more_warm` further warm epochs while each is short.

        `parts` is a list of (config, command, epoch -> per-worker args); parts
        that touch disjoint data share one system start (each still has its
        own cold and warm epoch). `listing`: directories every worker lists
        before its first epoch, untimed, as a Dataset does when it is built
        (ImageFolder scans its class directories), so file metadata comes from
        listings.
        """
        workers = Workers(system.reader_spec(client), n_readers, timeout=self.timeout)
        try:
            e, last = first_epoch, first_epoch + epochs - 1
            while e <= last:
                if e == 1 and client == 0:
                    self._drop_page_cache()
                if e == first_epoch and listing:
                    workers.run_all("list", listing)
                rows = [self._measure(system, workers, cmd, epoch_args(e),
                                      {"workload": workload, "config": config, "epoch": e,
                                       "phase": "cold" if e == 1 else "warm", "client": client})
                        for config, cmd, epoch_args in parts]
                if e == last and e > 1 and more_warm and max(
                        r["seconds"] for r in rows) < LONG_EPOCH_S:
                    last, more_warm = last + 1, more_warm - 1
                e += 1
        finally:
            workers.close()

    def _guard(self, workload: str, config: str, system: System, body) -> None:
        tag = f"{workload}-{config}".replace(" ", "")
        t0 = time.monotonic()
        try:
            system.start(self.ctx, tag)
            body()
        except Exception as exc:
            log.error("%s %s on %s failed: %s", workload, config, system.name, exc)
            self.errors.append({"workload": workload, "config": config, "system": system.name,
                                "error": f"{type(exc).__name__}: {exc}",
                                "trace": traceback.format_exc()[-3000:]})
        finally:
            system.stop()
            log.debug("%s %s %s took %.1f s", workload, config, system.name,
                      time.monotonic() - t0)

    # --- the workloads ---

    def small_files(self, system: System) -> None:
        size = self.ctx.size
        files = datasets.small_files(size)
        for n in size.readers:
            config = f"{n} reader" + ("s" if n > 1 else "")

            def args(e, n=n):
                order = datasets.shuffled(files, e)
                return [order[i::n] for i in range(n)]
            # A short warm epoch is one draw of a shared VM's CPU speed: the
            # warm figure is the median of `warm_epochs` (report.targets).
            self._guard("small-files", config, system, lambda n=n, config=config, args=args:
                        self._epochs(system, n, "small-files", [(config, "files", args)],
                                     listing=datasets.small_dirs(size),
                                     more_warm=size.warm_epochs - 1))

    def large_seq(self, system: System) -> None:
        shards = datasets.shards(self.ctx.size)
        self._guard("large-seq", "1 reader", system, lambda: self._epochs(
            system, 1, "large-seq", [("1 reader", "seq", lambda e: [shards])]))

    def random(self, system: System) -> None:
        # 4 KiB and 128 KiB reads go to different shards (datasets.random_reads),
        # so one start serves both sizes without one warming the other.
        reads = datasets.random_reads(self.ctx.size)
        parts = [(config, "ranges", lambda e, mine=[r for r in reads if r[2] == length]: [mine])
                 for length, config in ((4 << 10, "4 KiB"), (128 << 10, "128 KiB"))]
        self._guard("random", "4 KiB+128 KiB", system,
                    lambda: self._epochs(system, 1, "random", parts))

    def metadata(self, system: System) -> None:
        size = self.ctx.size
        files = datasets.small_files(size)[:size.stat_files]
        modules = datasets.module_names(size)
        parts = [("stat", "stat", lambda e: [datasets.shuffled(files, e, "stat")]),
                 ("import", "import", lambda e: [(datasets.PKG_ROOT, modules)])]

        self._guard("metadata", "stat+import", system,
                    lambda: self._epochs(system, 1, "metadata", parts))

    def shared(self, system: System) -> None:
        if system.name in _NO_CACHE:
            return
        size = self.ctx.size
        files = datasets.small_files(size)[:size.shared_files]
        config = f"{size.clients} clients"
        dirs = datasets.small_dirs(size)
        # Short warm epochs read one after another would compare two draws of
        # the VM's CPU speed: clients read in turns, the verdict takes medians.

        def body():
            self._epochs(system, 1, "shared", [(config, "files", lambda e: [
                datasets.shuffled(files, e, "shared")])], listing=dirs)
            for rnd in range(size.shared_rounds):
                # Client 0 again, with only the cache to go on (its warm
                # speed), beside new clients reading for their first time.
                system.restart_client(0)
                clients = [0] + [system.add_client() for _ in range(1, size.clients)]
                runs = []
                try:
                    for client in clients:
                        order = datasets.shuffled(files, 3 + 100 * rnd + client, "shared")
                        base = {"workload": "shared", "config": config, "client": client,
                                "round": rnd, "epoch": 3, "phase": "warm, restarted"}
                        if client:
                            base.update(epoch=1, phase="first epoch, new client",
                                        shares_cache=system.shares_cache)
                        runs.append(_Run(
                            Workers(system.reader_spec(client), 1, timeout=self.timeout),
                            "files", [[order[i:i + SHARED_SLICE]]
                                      for i in range(0, len(order), SHARED_SLICE)], base))
                        runs[-1].workers.run_all("list", dirs)
                    rows = self._measure_together(system, runs)
                finally:
                    for run in runs:
                        run.workers.close()
                # Epochs that wait on the remote (a client with a cache of
                # its own, or one that asks the remote about every file) are
                # long enough for one round to measure them.
                if min(r["seconds"] for r in rows) >= LONG_EPOCH_S:
                    break
        self._guard("shared", config, system, body)

    def run(self, workload: str, system: System) -> None:
        {"small-files": self.small_files, "large-seq": self.large_seq, "random": self.random,
         "metadata": self.metadata, "shared": self.shared}[workload](system)


@dataclass
class _Run:
    """One epoch of one group of workers, as `Runner._measure_together` takes
    it: `slices[i]` holds the per-worker arguments of its i-th call."""
    workers: Workers
    cmd: str
    slices: list[list]
    base: dict
    wall: float = 0.0
    answers: list[dict] = field(default_factory=list)
    srv_cpu: float = 0.0
    requests: int = 0
    bytes_down: int = 0
    stats0: dict = field(default_factory=dict)
    stats1: dict = field(default_factory=dict)


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _merge_stats(answers: list[dict]) -> dict:
    """Sum numeric counters over workers (each process or mount reports its own)."""
    out: dict = {}
    for a in answers:
        for k, v in a["stats"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


def _hit_ratio(before: dict, after: dict) -> float | None:
    if "hits" not in after or "misses" not in after:
        return None
    hits = after["hits"] - before.get("hits", 0)
    misses = after["misses"] - before.get("misses", 0)
    return hits / (hits + misses) if hits + misses else None
