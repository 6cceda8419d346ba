"""Disk full: the cache dir on a small tmpfs that runs out of bytes, and one
that runs out of inodes, with more data read than fits.

What must hold: the daemon stays up; fills that cannot be stored are dropped
and counted (`put_results`, `write_errors`); its usage never exceeds its
limit and the file system never fills past it; every read is correct; the
index still equals what is on disk.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time

import pytest

from blockcache_client import Volume
from blockcache_client.volumekey import load_key_file
from devtools.daemon import DaemonProcess
from tests.support.cache_audit import check_index_matches_disk
from tests.support.figures import record
from tests.support.remote_files import write_dataset
from tests.support.skips import needs_root
from tests.support.volumes import BS
from tests.support.waiting import wait_for

pytestmark = needs_root


@pytest.fixture
def tmpfs(tmp_path):
    """mount(options) -> a fresh tmpfs under tmp_path; unmounted at teardown."""
    made = []

    def mount(name: str, options: str) -> str:
        path = str(tmp_path / name)
        os.makedirs(path)
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], check=True,
                       capture_output=True, timeout=30)
        made.append(path)
        return path

    try:
        yield mount
    finally:
        for path in reversed(made):
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)


def _fill_up(path: str) -> int:
    """Write zeros to `path` until the file system is full; bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(b"\0" * 4096)
        except OSError:
            pass
    return n


class Sampler(threading.Thread):
    """Polls the daemon's stats and the file system while the test runs."""

    def __init__(self, daemon: DaemonProcess, path: str):
        super().__init__(daemon=True)
        self.client = daemon.client()
        self.path = path
        self.stop = threading.Event()
        self.over_limit: list[dict] = []
        self.samples = 0
        self.max_used = 0

    def run(self) -> None:
        while not self.stop.wait(0.05):
            d = self.client.stats()["dirs"][0]
            self.samples += 1
            self.max_used = max(self.max_used, d["used_bytes"] + d["reserved_bytes"])
            if d["used_bytes"] + d["reserved_bytes"] > d["limit_bytes"]:
                self.over_limit.append(d)


@pytest.mark.parametrize("kind, options", [
    ("bytes", "size=1m,nr_inodes=10000,mode=0755"),
    ("inodes", "size=64m,nr_inodes=48,mode=0755"),
])
def test_cache_dir_runs_out(tmp_path, key_file, tmpfs, kind, options):
    cache = tmpfs(f"fs-{kind}", options)
    rng = random.Random(7)
    files = write_dataset(str(tmp_path / "src"), [rng.randrange(BS // 2, BS) for _ in range(48)],
                          seed=7)
    total = sum(len(v) for v in files.values())
    # the configured size is far above what the file system holds
    daemon = DaemonProcess(tmp_path, cache_dirs=[(cache, "64M")])
    sampler = None
    try:
        daemon.start()
        daemon.wait_rebuilt()
        sampler = Sampler(daemon, cache)
        sampler.start()
        wrong = failed = reads = 0
        with Volume("vol", str(tmp_path / "src"), key_file, socket_path=daemon.socket_path,
                    block_size=BS, memory_cache_bytes=0) as vol:
            wait_for(lambda: vol.stats()["daemon_connected"], what="the volume to connect")
            names = sorted(files)
            hog = 0
            for n in range(3):
                if n == 1 and kind == "bytes":
                    # another tenant of the file system takes every byte left
                    hog = _fill_up(os.path.join(cache, "hog"))
                # a pass over everything, then, once its fills have landed, the
                # most recent few again (hits)
                for batch in (names, names[-4:]):
                    for rel in batch:
                        data = files[rel]
                        try:
                            got = vol.read(rel, 0, len(data))
                        except OSError:
                            failed += 1
                            continue
                        reads += 1
                        wrong += got != data
                    vol.wait_fills(10)
                    daemon.wait_idle()
                time.sleep(1.2)  # let the daemon see the file system's free space again
            vstats = vol.stats()
        sampler.stop.set()
        sampler.join(10)
        assert daemon.proc.poll() is None
        assert wrong == 0 and failed == 0
        assert sampler.over_limit == [], sampler.over_limit[:3]
        if hog:  # the daemon made room from its own blocks, never from others' files
            assert os.path.getsize(os.path.join(cache, "hog")) == hog
        s = check_index_matches_disk(daemon, load_key_file(key_file))
        st = os.statvfs(cache)
        refused = (s["put_results"].get("no_space", 0) + s["write_errors"] + s["drops"])
        # what did not fit was dropped and counted, or made room for by eviction
        assert refused + s["evictions"] > 0, s
        assert s["entries"] < len(files)
        assert vstats["hits"] > 0
        record(f"disk_full_{kind}", tmpfs=options, dataset_bytes=total, reads=reads,
               wrong_reads=wrong, failed_reads=failed, samples=sampler.samples,
               samples_over_limit=len(sampler.over_limit),
               put_results=s["put_results"], write_errors=s["write_errors"],
               evictions=s["evictions"], entries=s["entries"], used_bytes=s["used_bytes"],
               fs_free_bytes=st.f_bavail * st.f_frsize, fs_free_inodes=st.f_favail,
               reader_fills_dropped=vstats.get("fills_dropped", 0), hog_bytes=hog)
    finally:
        if sampler is not None:
            sampler.stop.set()
        daemon.stop()
