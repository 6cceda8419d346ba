"""Workload `cluster`: hosts sharing cached blocks through a memcached pool.

    python -m bench cluster [--size tiny|small|default|large] [--rtt-ms 2]

Hosts are real `blockcached` processes with their own cache dirs and
sockets, each read through its own `Volume`; the pool is 3 real memcached
servers on loopback; the remote is the suite's S3 server behind its latency
proxy (`--rtt-ms`, 2 ms by default). The dataset is files of one 4 MiB block.
Ratios, all from this one run:

1. host 1 reads the dataset cold, then hosts 2-4 each read it for their first
   time (each host lists the dataset first, untimed, and its daemon finishes
   writing before the next host starts: hosts of a cluster do not share 2
   CPUs): remote bytes over the 4 hosts <= 1.1x the dataset;
2. hosts 2-4's first epoch >= 5x faster than host 1's (the slowest of them);
3. a 4 KiB random read served from the tier moves <= 1 MiB (the most any did);
4. one of the 3 servers killed, two more fresh hosts read everything: 0
   failed reads, remote bytes <= (1.1 - 1) + that server's share of the items;
5. a dataset twice one host's cache, read by 3 fresh hosts with a fresh pool
   sized to hold it: hit ratio (local + tier, by bytes) >= 0.9 from epoch 2.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass

from blockcache_client import Volume
from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess
from devtools.memcached import MemcachedProcess

from .remote import Remote

BLOCK = 4 << 20
MIB = 1 << 20
FILES = {"tiny": 6, "small": 12, "default": 24, "large": 48}
RANDOM_READS = 40
# the readers' memory LRU: small, so an epoch's hits are the cache disk's and
# the tier's, not memory's
MEMORY = 8 << 20


@dataclass
class Target:
    what: str
    ratio: float
    limit: float
    at_most: bool  # the ratio must be <= limit (else >=)

    @property
    def met(self) -> bool:
        return self.ratio <= self.limit if self.at_most else self.ratio >= self.limit


class Rig:
    """Everything one scenario starts; `close` stops all of it."""

    def __init__(self, root: str, remote: Remote, prefix: str):
        self.root = root
        self.remote = remote
        self.url = f"s3://{remote.bucket}/{prefix}"
        self.servers: list[MemcachedProcess] = []
        self.hosts: list[DaemonProcess] = []
        self.volumes: list[Volume] = []
        os.makedirs(root, exist_ok=True)
        self.key_file = os.path.join(root, "volume.key")
        if not os.path.exists(self.key_file):
            generate_key_file(self.key_file)

    def pool(self, n: int, memory_mb: int) -> list[str]:
        for _ in range(n):
            self.servers.append(MemcachedProcess(memory_mb).start())
        return [m.address for m in self.servers]

    def host(self, cache_size: str = "4G") -> Volume:
        """A new host (daemon + its cache dir) pointed at the pool, and a reader on it."""
        home = os.path.join(self.root, f"host{len(self.hosts)}")
        os.makedirs(home)
        servers = ",".join(m.address for m in self.servers)
        d = DaemonProcess(home, cache_dirs=[(os.path.join(home, "cache"), cache_size)],
                          extra_args=["--memcached", servers])
        self.hosts.append(d)
        d.start()
        v = Volume("bench", self.url, self.key_file, socket_path=d.socket_path,
                   memory_cache_bytes=MEMORY, **self.remote.storage_options())
        self.volumes.append(v)
        return v

    def close(self) -> None:
        for v in self.volumes:
            v.close()
        for d in self.hosts:
            d.stop()
        for m in self.servers:
            m.stop()


def _upload(remote: Remote, prefix: str, n: int, seed: int) -> dict[str, bytes]:
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **remote.storage_options(direct=True))
    rng = random.Random(seed)
    files = {f"shard-{i:04d}.bin": rng.randbytes(BLOCK) for i in range(n)}
    fs.pipe({f"{remote.bucket}/{prefix}/{k}": v for k, v in files.items()})
    return files


def _epoch(v: Volume, files: dict[str, bytes], seed: int) -> tuple[float, int]:
    """Read every file whole in a shuffled order, checking its bytes; (seconds,
    failed reads). The dataset's directory is listed first, untimed, as a
    Dataset is built before its epochs (the suite's convention: file metadata
    comes from the listing). The fills are then waited for (outside the time)."""
    order = sorted(files)
    random.Random(seed).shuffle(order)
    v.listdir("")
    failed = 0
    t = time.monotonic()
    for rel in order:
        try:
            if v.read(rel, 0, BLOCK) != files[rel]:
                failed += 1
        except OSError:
            failed += 1
    took = time.monotonic() - t
    v.wait_fills(60)
    return took, failed


def share_and_speed(remote: Remote, root: str, n: int) -> list[Target]:
    files = _upload(remote, "cluster-share", n, 1)
    total = n * BLOCK
    rig = Rig(os.path.join(root, "share"), remote, "cluster-share")
    try:
        rig.pool(3, max(64, 2 * n * 4 // 3 + 16))
        hosts = [rig.host() for _ in range(4)]
        times = []
        for i, v in enumerate(hosts):
            took, failed = _epoch(v, files, i)
            assert failed == 0, f"host {i + 1}: {failed} failed reads"
            times.append(took)
            # Hosts of a cluster have CPUs of their own; here they share 2, so
            # this host's daemon finishes writing before the next host's epoch.
            rig.hosts[i].wait_idle(60)
        remote_bytes = sum(v.stats()["backend_bytes"] for v in hosts)
        # 3. random 4 KiB reads on a fresh host: each takes the one item it is in
        probe = rig.host()
        rng = random.Random(3)
        moved = []
        for _ in range(RANDOM_READS):
            rel = rng.choice(sorted(files))
            off = rng.randrange(1, BLOCK - 4096)
            before = probe.stats()["cluster_bytes"]
            assert probe.read(rel, off, 4096) == files[rel][off:off + 4096]
            moved.append(probe.stats()["cluster_bytes"] - before)
        # 4. a server dies; two fresh hosts read everything
        items = [int(m.stats()["curr_items"]) for m in rig.servers]
        share = items[0] / sum(items)
        rig.servers[0].kill()
        after = [rig.host(), rig.host()]
        failed = 0
        for i, v in enumerate(after):
            failed += _epoch(v, files, 10 + i)[1]
        remote_after = sum(v.stats()["backend_bytes"] for v in after)
        print(f"cluster: host 1 cold epoch {times[0]:.2f} s; hosts 2-4 "
              f"{', '.join(f'{t:.2f}' for t in times[1:])} s; remote {remote_bytes / MIB:.0f} "
              f"MiB for a {total / MIB:.0f} MiB dataset over 4 hosts; random 4 KiB reads "
              f"moved {min(moved) / MIB:.2f}..{max(moved) / MIB:.2f} MiB; killed server held "
              f"{share:.2f} of the items; after it, {failed} failed reads and "
              f"{remote_after / MIB:.0f} MiB from the remote")
        return [
            Target("remote bytes over 4 hosts / dataset", remote_bytes / total, 1.1, True),
            Target("host 1's cold epoch / the slowest of hosts 2-4's first",
                   times[0] / max(times[1:]), 5.0, False),
            Target("MiB one 4 KiB tier read moved (the most)", max(moved) / MIB, 1.0, True),
            Target("failed reads with 1 of 3 servers killed", failed, 0, True),
            Target(f"remote bytes after the kill / dataset (<= 0.1 + share {share:.2f})",
                   remote_after / total, 0.1 + share, True),
        ]
    finally:
        rig.close()


def larger_than_a_host(remote: Remote, root: str, n: int, epochs: int = 3) -> list[Target]:
    files = _upload(remote, "cluster-2x", n, 2)
    total = n * BLOCK
    rig = Rig(os.path.join(root, "twice"), remote, "cluster-2x")
    try:
        # each server holds half the dataset: the pool 1.5x it, room for slab overhead
        rig.pool(3, max(64, n * 4 // 2 + 16))
        hosts = [rig.host(cache_size=f"{total // 2 // MIB}M") for _ in range(3)]
        ratios = []
        for e in range(epochs):
            got = []
            for i, v in enumerate(hosts):
                before = v.stats()["backend_bytes"]
                _, failed = _epoch(v, files, 100 * e + i)
                assert failed == 0
                got.append(1 - (v.stats()["backend_bytes"] - before) / total)
            ratios.append(min(got))
        print(f"cluster: dataset 2x a host's cache, 3 hosts: worst host's hit ratio (local + "
              f"tier) per epoch {', '.join(f'{r:.2f}' for r in ratios)}")
        return [Target("hit ratio (local + tier) from epoch 2, dataset 2x a host's cache",
                       min(ratios[1:]), 0.9, False)]
    finally:
        rig.close()


def run_all(size: str, rtt_ms: float, workdir: str) -> list[Target]:
    n = FILES[size]
    root = tempfile.mkdtemp(prefix="cluster-", dir=workdir)
    try:
        with Remote(rtt_ms=rtt_ms, log_path=os.path.join(root, "moto.log")) as remote:
            return share_and_speed(remote, root, n) + larger_than_a_host(remote, root, n)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def table(targets: list[Target]) -> str:
    lines = [f"{'target':<70} {'ratio':>8} {'limit':>8}  verdict"]
    for t in targets:
        lines.append(f"{t.what:<70} {t.ratio:>8.2f} {('<= ' if t.at_most else '>= ')}"
                     f"{t.limit:<5.2f}  {'MET' if t.met else 'MISS'}")
    return "\n".join(lines)
