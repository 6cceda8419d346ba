"""`python -m devtools.demo` (what `make demo` runs): the whole path in two minutes.

1. makes a sample dataset in a temporary "remote" directory: a few thousand
   image-sized files (~100 KiB) in a few dozen directories plus two large
   shards, served through `latency::` with a delay per request (2 ms);
2. starts `blockcached` on a temporary cache dir and socket;
3. mounts the dataset with `fsclient mount` and reads one epoch (8 reader
   threads, like DataLoader workers) with a progress bar: cold, from the remote;
4. unmounts and mounts again, as the next job or another pod on this host
   would, and reads the second epoch: from the shared block cache (a fresh
   mount, so the kernel page cache of the first one does not count);
5. prints a table (files/s, MB/s, hit ratio, epoch 1 vs 2), unmounts (which
   sends the mount's last access reports), prints `blockcache-cli stats`,
   stops the daemon, removes the temp dir.

Everything started here is stopped in `finally`, on error and on Ctrl-C:
nothing stays running or mounted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from blockcache_client.contract.errors import BlockcacheError
from blockcache_client.daemonclient.client import Client
from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess
from fsclient import mountpoint as mp
from fsclient.config import build_config, load_toml
from fsclient.mount import spawn

READERS = 8
CHUNK = 1 << 20


@dataclass
class Dataset:
    root: str
    files: list[tuple[str, int]]  # (relative path, size), small first, shards last

    @property
    def total_bytes(self) -> int:
        return sum(s for _, s in self.files)


def make_dataset(root: str, n_files: int, n_dirs: int, large: int, large_size: int,
                 seed: int = 7) -> Dataset:
    """Random bytes (incompressible, like JPEGs), ~100 KiB each, in n_dirs dirs."""
    rng = random.Random(seed)
    files = []
    for d in range(n_dirs):
        os.makedirs(os.path.join(root, "train", f"class{d:03d}"), exist_ok=True)
    for i in range(n_files):
        rel = f"train/class{i % n_dirs:03d}/img{i:06d}.jpg"
        size = rng.randint(40 << 10, 160 << 10)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(rng.randbytes(size))
        files.append((rel, size))
    os.makedirs(os.path.join(root, "shards"), exist_ok=True)
    for i in range(large):
        rel = f"shards/shard-{i:02d}.bin"
        with open(os.path.join(root, rel), "wb") as f:
            for _ in range(large_size // CHUNK):
                f.write(rng.randbytes(CHUNK))
        files.append((rel, large_size))
    return Dataset(root, files)


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, label: str, total_files: int, total_bytes: int):
        self.label, self.total_files, self.total_bytes = label, total_files, total_bytes
        self.files = self.bytes = 0
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self._last = 0.0
        self.tty = sys.stderr.isatty()

    def add(self, nbytes: int, files: int = 0) -> None:
        with self._lock:
            self.bytes += nbytes
            self.files += files
            now = time.monotonic()
            if now - self._last >= (0.1 if self.tty else 2.0):
                self._last = now
                self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        frac = self.bytes / max(self.total_bytes, 1)
        bar = "#" * int(frac * 30)
        rate = self.bytes / max(now - self.start, 1e-9) / 1e6
        line = (f"{self.label}: [{bar:<30}] {frac * 100:5.1f}%  {self.files}/{self.total_files} "
                f"files  {rate:7.1f} MB/s")
        sys.stderr.write(("\r" + line + end) if self.tty else (line + "\n"))
        sys.stderr.flush()

    def done(self) -> None:
        self._draw(time.monotonic(), end="\n" if self.tty else "")


def read_epoch(mount: str, ds: Dataset, label: str) -> tuple[float, int]:
    """Read every file once with READERS threads; returns (seconds, bytes)."""
    prog = Progress(label, len(ds.files), ds.total_bytes)
    order = list(ds.files)
    random.Random(label).shuffle(order)  # training reads in a shuffled order

    def read(item: tuple[str, int]) -> int:
        rel, size = item
        n = 0
        with open(os.path.join(mount, rel), "rb", buffering=0) as f:
            while True:
                chunk = f.read(CHUNK)
                if not chunk:
                    break
                n += len(chunk)
                if size > CHUNK:
                    prog.add(len(chunk))
        if n != size:
            raise OSError(f"{rel}: read {n} bytes, expected {size}")
        prog.add(0 if size > CHUNK else n, files=1)
        return n

    start = time.monotonic()
    pool = ThreadPoolExecutor(READERS)
    try:
        total = sum(pool.map(read, order))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    seconds = time.monotonic() - start
    prog.done()
    return seconds, total


def stop_mount(proc: subprocess.Popen, mountpoint: str) -> None:
    """SIGTERM a mount process (it unmounts), kill it if it hangs, and lazily
    unmount whatever it left behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if mp.is_mounted(mountpoint):
        mp.unmount(mp.absolute(mountpoint), lazy=True)


class Demo:
    """Owns every process, mount and temp file the demo makes."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="blockcache-demo-")
        self.socket = os.path.join(self.tmp, "blockcached.sock")  # DaemonProcess's socket
        self.mountpoint = os.path.join(self.tmp, "mnt")
        self.daemon: DaemonProcess | None = None
        self.mount_proc: subprocess.Popen | None = None

    def say(self, text: str) -> None:
        print(text, flush=True)

    def start_daemon(self) -> None:
        self.daemon = DaemonProcess(self.tmp, [(os.path.join(self.tmp, "cache"), "4G")]).start()

    def write_config(self, remote: str) -> str:
        path = os.path.join(self.tmp, "demo.toml")
        key = os.path.join(self.tmp, "demo.key")
        generate_key_file(key)
        with open(path, "w") as f:
            f.write(f'volume = "demo"\nsource = "latency::file://{remote}"\n'
                    f'mountpoint = "{self.mountpoint}"\nkey_file = "{key}"\n'
                    f'socket = "{self.socket}"\nblock_size = "4M"\nmeta_ttl = 300\n'
                    f'[storage_options]\nlatency = {{delay = {self.args.delay}}}\n')
        return path

    def mount(self, config: str) -> None:
        os.makedirs(self.mountpoint, exist_ok=True)
        cfg = build_config(load_toml(config))
        # not detached: a Ctrl-C reaches the mount too, and it unmounts itself
        child, why = spawn(["mount", "--config", config], cfg,
                           os.path.join(self.tmp, "fsclient.log"), detach=False)
        if child is None:
            raise RuntimeError(f"fsclient mount failed: {why}")
        self.mount_proc = child

    def stats(self) -> dict:
        return json.loads(os.getxattr(self.mountpoint, "user.blockcache.stats"))

    def wait_fills(self, timeout: float = 60.0) -> None:
        """Let the mount hand its queued fills to the daemon, and the daemon
        write them, so the next epoch finds them."""
        deadline = time.monotonic() + timeout
        with Client(self.socket) as c:
            while time.monotonic() < deadline:
                queue = c.stats().get("queue", {})
                if self.stats().get("fill_queue_bytes", 0) == 0 and not queue.get("entries"):
                    return
                time.sleep(0.1)

    def unmount(self) -> None:
        proc, self.mount_proc = self.mount_proc, None
        if proc is not None:
            stop_mount(proc, self.mountpoint)

    def cleanup(self) -> None:
        try:
            self.unmount()
        except Exception as exc:  # keep going: the daemon and temp dir still need cleaning
            print(f"demo: cleanup: {exc}", file=sys.stderr)
        if self.daemon is not None:
            self.daemon.stop()
        if self.args.keep:
            return
        if mp.is_mounted(self.mountpoint):
            # never let rmtree walk into a mount (it would try every file of the volume)
            print(f"demo: {self.mountpoint} is still mounted; leaving {self.tmp} in place",
                  file=sys.stderr)
            return
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run(self) -> int:
        a = self.args
        remote = os.path.join(self.tmp, "remote")
        self.say(f"blockcache demo in {self.tmp}")
        t = time.monotonic()
        ds = make_dataset(remote, a.files, a.dirs, a.large, a.large_mib << 20)
        self.say(f"dataset: {a.files} files (~100 KiB) in {a.dirs} dirs + {a.large} x "
                 f"{a.large_mib} MiB shards = {ds.total_bytes / 1e6:.0f} MB, made in "
                 f"{time.monotonic() - t:.1f}s; remote = latency::file://{remote} "
                 f"({a.delay * 1000:g} ms per request)")
        self.start_daemon()
        config = self.write_config(remote)
        self.mount(config)
        self.say(f"mounted on {self.mountpoint}; blockcached on {self.socket}")
        rows = []
        for epoch in (1, 2):
            if epoch == 2:
                self.wait_fills()
                self.unmount()
                self.mount(config)
                self.say("remounted (a new job or pod on this host): epoch 2 reads the "
                         "shared block cache, not this mount's page cache")
            seconds, total = read_epoch(self.mountpoint, ds, f"epoch {epoch}")
            remote_bytes = self.stats().get("backend_bytes", 0)
            # the share of bytes read that did not come from the remote
            served = max(0.0, 1.0 - remote_bytes / max(total, 1))
            rows.append((epoch, seconds, len(ds.files) / seconds, total / seconds / 1e6,
                         served, remote_bytes))
        self.say("")
        self.say(f"{'epoch':>5} {'seconds':>8} {'files/s':>9} {'MB/s':>8} {'hit ratio':>10} "
                 f"{'from remote':>12}")
        for epoch, sec, fps, mbs, ratio, remote_bytes in rows:
            self.say(f"{epoch:>5} {sec:>8.2f} {fps:>9.0f} {mbs:>8.1f} {ratio * 100:>9.1f}% "
                     f"{remote_bytes / 1e6:>9.0f} MB")
        self.say(f"epoch 2 is {rows[0][1] / rows[1][1]:.1f}x faster than epoch 1\n")
        # unmounting first sends the mount's last batch of access reports, so
        # the daemon's reader counters below cover every read of epoch 2
        self.unmount()
        self.say("$ blockcache-cli stats")
        res = subprocess.run([sys.executable, "-m", "blockcache_client.cli", "--socket",
                              self.socket, "stats"], capture_output=True, text=True, timeout=30)
        self.say((res.stdout or res.stderr).rstrip())
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.demo", description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--dirs", type=int, default=30)
    p.add_argument("--large", type=int, default=2, help="number of large shards")
    p.add_argument("--large-mib", type=int, default=64)
    p.add_argument("--delay", type=float, default=0.002, help="seconds per remote request")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs) afterwards")
    args = p.parse_args(argv)
    if os.geteuid() != 0 and not shutil.which("fusermount3"):
        print("demo: needs fusermount3 (apt-get install fuse3) or root", file=sys.stderr)
        return 1
    demo = Demo(args)
    interrupted = []

    def on_sigint(signum: int, frame: object) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, on_sigint)
    try:
        return demo.run()
    except KeyboardInterrupt:
        print("\ndemo: interrupted; cleaning up", file=sys.stderr)
        return 130
    except (RuntimeError, OSError, BlockcacheError) as exc:
        if interrupted:  # the mount went away under the readers because of Ctrl-C
            print("\ndemo: interrupted; cleaning up", file=sys.stderr)
            return 130
        print(f"demo: error: {exc}", file=sys.stderr)
        if args.keep:
            print(f"demo: logs are in {demo.tmp}", file=sys.stderr)
        return 1
    finally:
        demo.cleanup()


if __name__ == "__main__":
    sys.exit(main())
