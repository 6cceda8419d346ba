"""Crashes under load: the daemon killed with -9 while four readers read and
fill; a FUSE client killed with -9 next to another mount.

What must hold: every read returns the source's bytes (checked by sha256),
no read fails, and after the last restart the index is exactly the complete
blocks on disk (no temp file indexed, `stats` equal to what is on disk).
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import pytest

from blockcache_client import Volume
from blockcache_client.volumekey import load_key_file
from devtools.daemon import DaemonProcess
from tests.support.cache_audit import check_index_matches_disk
from tests.support.figures import record
from tests.support.fsclient_mounts import FsclientMount, is_mounted
from tests.support.proc_files import peak_rss_kib
from tests.support.remote_files import sha, write_dataset
from tests.support.skips import needs_fuse
from tests.support.volumes import BS
from tests.support.waiting import wait_for

pytestmark = needs_fuse

KILLS = 3
RUN_BETWEEN_KILLS = 0.8   # seconds of load before each kill -9
DOWN_FOR = 0.2            # seconds the daemon stays dead


class Tally:
    """Reads checked against the source, per reader kind."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reads = {"fuse": 0, "volume": 0}
        self.wrong_bytes = 0
        self.failed: list[str] = []

    def check(self, kind: str, what: str, got: bytes, want: bytes) -> None:
        with self.lock:
            self.reads[kind] += 1
            if sha(got) != sha(want):
                self.wrong_bytes += (sum(a != b for a, b in zip(got, want))
                                     + abs(len(got) - len(want)))
                self.failed.append(f"{what}: wrong bytes")

    def fail(self, what: str, exc: BaseException) -> None:
        with self.lock:
            self.failed.append(f"{what}: {exc!r}")


def fuse_reader(root: str, files: dict[str, bytes], tally: Tally, stop: threading.Event,
                seed: int) -> None:
    rng = random.Random(seed)
    names = sorted(files)
    while not stop.is_set():
        rel = rng.choice(names)
        try:
            fd = os.open(os.path.join(root, rel), os.O_RDONLY)
            try:
                got = b""
                while chunk := os.read(fd, 1 << 20):
                    got += chunk
                # drop the kernel's page cache, so the next read goes through FUSE again
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as exc:
            tally.fail(f"fuse {rel}", exc)
            continue
        tally.check("fuse", f"fuse {rel}", got, files[rel])


def volume_reader(vol: Volume, files: dict[str, bytes], tally: Tally, stop: threading.Event,
                  seed: int) -> None:
    rng = random.Random(seed)
    names = sorted(files)
    while not stop.is_set():
        rel = rng.choice(names)
        size = len(files[rel])
        off = rng.randrange(0, max(1, size))
        n = rng.choice([1, 4096, BS, 3 * BS, size])
        try:
            got = vol.read(rel, off, n)
        except OSError as exc:
            tally.fail(f"volume {rel}@{off}+{n}", exc)
            continue
        tally.check("volume", f"volume {rel}@{off}+{n}", got, files[rel][off:off + n])


def test_daemon_killed_under_load(tmp_path, key_file):
    rng = random.Random(2)
    files = write_dataset(str(tmp_path / "src"), [rng.randrange(1, 5 * BS) for _ in range(36)])
    total = sum(len(v) for v in files.values())
    # two dirs much smaller than the data, under plain LRU: fills and evictions
    # never stop, so each kill lands amid writes. (The default TinyLFU keeps a
    # fixed set of uniformly read blocks and refuses nearly every put once the
    # dirs are full; test_policy covers what it keeps across a restart.)
    daemon = DaemonProcess(tmp_path, cache_dirs=[(tmp_path / "c0", "1M"), (tmp_path / "c1", "1M")],
                           extra_args=["--admission-policy", "lru"])
    cfg = tmp_path / "mount.toml"
    cfg.write_text("memory_cache_bytes = 0\n")  # every FUSE read asks the cache disk or the source
    mounts = [FsclientMount(str(tmp_path / "src"), str(tmp_path / f"m{i}"), key_file,
                            daemon.socket_path, volume="vol",
                            args=["--block-size", str(BS), "--config", str(cfg)],
                            log_path=str(tmp_path / f"m{i}.log")) for i in range(2)]
    vols: list[Volume] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    tally = Tally()
    try:
        daemon.start()
        for m in mounts:
            m.start()
        vols = [Volume("vol", str(tmp_path / "src"), key_file, socket_path=daemon.socket_path,
                       block_size=BS, memory_cache_bytes=0) for _ in range(2)]
        for i, m in enumerate(mounts):
            threads.append(threading.Thread(target=fuse_reader,
                                            args=(m.mountpoint, files, tally, stop, i)))
        for i, v in enumerate(vols):
            threads.append(threading.Thread(target=volume_reader,
                                            args=(v, files, tally, stop, 10 + i)))
        for t in threads:
            t.start()
        restarts = []
        for _ in range(KILLS):
            time.sleep(RUN_BETWEEN_KILLS)
            daemon.kill()
            time.sleep(DOWN_FOR)
            t0 = time.monotonic()
            daemon.start()
            restarts.append(time.monotonic() - t0)
        # readers find the restarted daemon again and go on filling it
        wait_for(lambda: all(v.stats()["daemon_connected"] for v in vols), 10,
                 "the volumes to reconnect")
        time.sleep(RUN_BETWEEN_KILLS)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        vol_stats = [v.stats() for v in vols]
        mount_stats = []
        for m in mounts:
            try:
                mount_stats.append(m.stats())
            except OSError:
                pass
        for v in vols:
            v.close()
        for m in mounts:
            m.stop()
    try:
        assert not tally.failed, tally.failed[:10]
        assert tally.wrong_bytes == 0
        assert tally.reads["fuse"] > 20 and tally.reads["volume"] > 20, tally.reads
        # every reader gone (only our stats connection left): no put can land after
        # the snapshot, so the cold-start scan below must find exactly the same
        daemon.wait_stats(lambda s: s["connections"] <= 1, timeout=20)
        s = check_index_matches_disk(daemon, load_key_file(key_file))
        assert s["writes"] > 0, s  # the last daemon was filled, not just read
        peak = peak_rss_kib(daemon.proc.pid)  # the last run: under load, then idle
        # and once more from a cold start: the scan finds the same
        daemon.kill()
        daemon.start()
        s2 = check_index_matches_disk(daemon, load_key_file(key_file))
        assert s2["entries"] == s["entries"] and s2["used_bytes"] == s["used_bytes"]
        hits = sum(x["hits"] for x in vol_stats + mount_stats)
        assert hits > 0 and sum(x["misses"] for x in vol_stats + mount_stats) > 0
        record("daemon_killed_under_load", kills=KILLS, dataset_bytes=total,
               reads_fuse=tally.reads["fuse"], reads_volume=tally.reads["volume"],
               wrong_bytes=tally.wrong_bytes, failed_reads=len(tally.failed),
               restart_to_ping_s=round(max(restarts), 3), entries_after=s["entries"],
               cache_hits=hits, last_daemon_peak_rss_mib=round(peak / 1024, 1),
               integrity_failures=sum(x["integrity_failures"]
                                                       for x in vol_stats + mount_stats))
    finally:
        daemon.stop()


def _read_tree(root: str, files: dict[str, bytes]) -> int:
    """Read every file under a mount; the number whose bytes differ from the source."""
    bad = 0
    for rel, data in files.items():
        with open(os.path.join(root, rel), "rb") as f:
            bad += sha(f.read()) != sha(data)
    return bad


def test_fuse_client_killed_other_mount_untouched(tmp_path, key_file):
    files = write_dataset(str(tmp_path / "src"), [1000, BS + 5, 3 * BS], seed=3)

    def mk(name: str) -> FsclientMount:
        return FsclientMount(str(tmp_path / "src"), str(tmp_path / name), key_file,
                             daemon.socket_path, volume="vol", args=["--block-size", str(BS)],
                             log_path=str(tmp_path / f"{name}.{time.monotonic_ns()}.log"))
    daemon = DaemonProcess(tmp_path)
    made: list[FsclientMount] = []
    try:
        daemon.start()
        victim, bystander = mk("victim"), mk("bystander")
        made += [victim, bystander]
        victim.start()
        bystander.start()
        assert _read_tree(victim.mountpoint, files) == 0
        bystander_pid = bystander.proc.pid
        victim.kill9()
        with pytest.raises(OSError) as exc:
            os.listdir(victim.mountpoint)
        assert exc.value.errno == errno.ENOTCONN
        # the other mount on the host goes on as if nothing happened
        assert _read_tree(bystander.mountpoint, files) == 0
        t0 = time.monotonic()
        again = mk("victim")
        made.append(again)
        again.start()
        recovered = time.monotonic() - t0
        assert any("dead FUSE mount" in w for w in again.warnings), again.warnings
        assert _read_tree(again.mountpoint, files) == 0
        assert is_mounted(bystander.mountpoint) and bystander.proc.poll() is None
        assert bystander.proc.pid == bystander_pid
        assert _read_tree(bystander.mountpoint, files) == 0
        record("fuse_client_killed", recovery_mount_s=round(recovered, 2),
               other_mount_reads_ok=True)
    finally:
        for m in reversed(made):
            m.stop()
        daemon.stop()
