"""Benchmark of one cluster-tier hit: what a 4 MiB block from memcached costs.

    python -m bench.tier_hit [--blocks 8] [--rounds 6] [--workdir DIR]

One real memcached and two real daemons on loopback. A first `Volume` reads
`--blocks` files of one 4 MiB block from a local dir (filling the tier); a
second one, on the other daemon, takes them from the tier again and again
(`TierReads.blocks`, what a read's miss calls), and prints per block:

- the reading thread's CPU (`time.thread_time`) and wall, with the block
  handed to the daemon as a read does, and without (the link taken as not
  connected: the tier's own cost);
- the daemon's CPU per 4 MiB block it is handed (all its threads, from
  /proc/PID/task/*/schedstat: taking the put and writing the block file,
  from the reader's fill area when it has one).

Target: a hit (with the hand-off) <= 3.5 ms wall: what `python -m bench
cluster`'s hosts 2-4 need to be 5x faster than host 1's cold epoch when moto
serves a 4 MiB block in ~18 ms. The first round (connections, ciphers) is
left out; the median of the others is printed. On a small shared VM every
figure moves with the load: compare runs of one session.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from blockcache_client import Volume
from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess
from devtools.memcached import MemcachedProcess

BLOCK = 4 << 20
TARGET_MS = 3.5


def _cpu_seconds(pid: int) -> float:
    """CPU of all of a process's threads so far, to the nanosecond
    (/proc/PID/task/*/schedstat: clock ticks are too coarse for ~1 ms a block)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return total / 1e9


def _rounds(v: Volume, keys: list[str], rounds: int, daemon: DaemonProcess
            ) -> tuple[float, float, float]:
    """Median over rounds 2.. of (thread CPU ms, wall ms, daemon CPU ms) per block."""
    cpu, wall, daemon_cpu = [], [], []
    admin = daemon.client()
    for _ in range(rounds):
        for key in keys:  # so each round's hand-off is written again, as a first one is
            admin.evict(key)
        daemon.wait_idle(60)
        d0 = _cpu_seconds(daemon.proc.pid)
        spent = 0.0
        start = time.perf_counter()
        for key in keys:
            t = time.thread_time()
            got = v._tier.blocks([(key, BLOCK)])
            spent += time.thread_time() - t
            if len(got.get(key, b"")) != BLOCK:
                raise RuntimeError(f"block {key} was not a tier hit: is memcached full?")
        wall.append((time.perf_counter() - start) * 1000 / len(keys))
        v.wait_fills(60)
        daemon.wait_idle(60)
        cpu.append(spent * 1000 / len(keys))
        daemon_cpu.append((_cpu_seconds(daemon.proc.pid) - d0) * 1000 / len(keys))
    return tuple(statistics.median(x[1:]) for x in (cpu, wall, daemon_cpu))


def run(blocks: int, rounds: int, workdir: str) -> float:
    """Print the figures; the hit's wall ms with the hand-off."""
    root = tempfile.mkdtemp(prefix="tier-hit-", dir=workdir)
    src = os.path.join(root, "src")
    os.makedirs(src)
    for i in range(blocks):
        with open(os.path.join(src, f"f{i:03d}"), "wb") as f:
            f.write(os.urandom(BLOCK))
    key_file = os.path.join(root, "volume.key")
    generate_key_file(key_file)
    server = MemcachedProcess(max(64, 2 * blocks * 4)).start()
    daemons: list[DaemonProcess] = []
    volumes: list[Volume] = []
    try:
        for n in range(2):
            home = os.path.join(root, f"host{n}")
            os.makedirs(home)
            d = DaemonProcess(home, cache_dirs=[(os.path.join(home, "cache"), "4G")],
                              extra_args=["--memcached", server.address])
            daemons.append(d)
            d.start()
            volumes.append(Volume("bench", src, key_file, socket_path=d.socket_path,
                                  memory_cache_bytes=8 << 20))
        first, second = volumes
        names = sorted(os.listdir(src))
        for name in names:
            first.read(name, 0, BLOCK)
        first.wait_fills(60)
        keys = [second._key_prefix(n, second.stat(n).version) + format(0, "016x")
                for n in names]
        cpu, wall, daemon_cpu = _rounds(second, keys, rounds, daemons[1])
        print(f"tier hit, handed to the daemon: {wall:.2f} ms wall, {cpu:.2f} ms CPU of the "
              f"reading thread; the daemon {daemon_cpu:.2f} ms CPU per block")
        second._link.layout = None  # "not connected": the tier's part alone
        cpu_alone, wall_alone, _ = _rounds(second, keys, rounds, daemons[1])
        print(f"tier hit alone: {wall_alone:.2f} ms wall, {cpu_alone:.2f} ms CPU")
        verdict = "MET" if wall <= TARGET_MS else "MISS"
        print(f"target: hit with hand-off <= {TARGET_MS} ms wall: {wall:.2f}  {verdict}")
        return wall
    finally:
        for v in volumes:
            v.close()
        for d in daemons:
            d.stop()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tier_hit",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=8, help="4 MiB blocks in the tier")
    p.add_argument("--rounds", type=int, default=6, help="reads of them all (>= 2)")
    p.add_argument("--workdir", default=tempfile.gettempdir(),
                   help="scratch for the source dir, caches and sockets")
    args = p.parse_args(argv)
    if args.blocks < 1 or args.rounds < 2:
        p.error("--blocks must be >= 1 and --rounds >= 2 (the first round is left out)")
    run(args.blocks, args.rounds, args.workdir)


if __name__ == "__main__":
    main()
