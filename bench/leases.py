"""Many readers, one fetch: what cold readers of one file across two FUSE
mounts cost the remote, with fetch leases and without.

    python -m bench.leases                        # 4 readers, a 256 MiB file, 4 MiB blocks
    python -m bench.leases --readers 8 --file-mib 512 --out /tmp/leases.json

Two pods of one node mounting the same volume, several ranks in each
loading one checkpoint: N readers (half on each of 2 fsclient mounts of one
volume, one daemon) read one cold file front to back in 1 MiB reads, all
started at once. Each case runs on a fresh daemon and cache dir and fresh
mounts, so every read is cold, once with `--lease-timeout 0` (no leases:
before) and once with the daemon's default (after), plus one reader alone
for the wall-time ratio. The remote is moto with ranged GETs that copy only
their range (`bench.moto_ranges`) behind a byte-counting proxy
(`bench.remote.LatencyProxy`); "remote / file" is the bytes it sent (bodies
and the few metadata answers) over the file's size.

Prints one row per case: remote bytes / file size, wall time (the last
reader's end), wall time / one reader's alone. Not a test: no target is
asserted here (docs/reader.md, "Many readers, one fetch").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess
from devtools.demo import stop_mount
from devtools.s3server import S3Server
from fsclient.config import build_config, load_toml
from fsclient.mount import spawn

from . import PROJECT_ROOT
from .remote import ACCESS_KEY, REGION, SECRET_KEY, LatencyProxy

MIB = 1 << 20
FILE = "ckpt/model.bin"
# a reader: waits for a line on stdin, reads its file in 1 MiB reads, prints the seconds
READER = """
import sys, time
path = sys.argv[1]
print("ready", flush=True)
sys.stdin.readline()
start = time.monotonic()
with open(path, "rb", buffering=0) as f:
    while f.read(1 << 20):
        pass
print(time.monotonic() - start, flush=True)
"""


class Bench:
    """The remote, the proxy and the scratch dir; a fresh daemon and mounts per case."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="bc-leases-", dir=args.workdir)
        self.key = os.path.join(self.tmp, "volume.key")
        generate_key_file(self.key)
        self.moto = S3Server("bench", module="bench.moto_ranges",
                             env={"PYTHONPATH": PROJECT_ROOT,
                                  "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(4 << 30)},
                             log_path=os.path.join(self.tmp, "moto.log"))
        self.proxy: LatencyProxy | None = None

    def start(self) -> None:
        self.moto.start()
        self.proxy = LatencyProxy(("127.0.0.1", self.moto.port), self.args.rtt_ms).start()
        fs = self.moto.filesystem()
        size = self.args.file_mib * MIB
        with fs.open(f"bench/{FILE}", "wb") as f:
            for _ in range(self.args.file_mib):
                f.write(os.urandom(MIB))
        assert fs.size(f"bench/{FILE}") == size

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.moto.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def case(self, name: str, readers: int, lease_timeout: str | None) -> dict:
        """`readers` cold readers at once over 2 fresh mounts of a fresh daemon."""
        case_dir = os.path.join(self.tmp, name)
        os.makedirs(case_dir)
        extra = [] if lease_timeout is None else ["--lease-timeout", lease_timeout]
        daemon = DaemonProcess(case_dir, [(os.path.join(case_dir, "cache"), "8G")],
                               extra_args=extra).start()
        mounts: list[tuple[subprocess.Popen, str]] = []
        procs: list[subprocess.Popen] = []
        try:
            for pod in ("a", "b")[:min(2, readers)]:
                mounts.append(self._mount(case_dir, pod, daemon.socket_path))
            for i in range(readers):
                path = os.path.join(mounts[i % len(mounts)][1], FILE)
                procs.append(subprocess.Popen([sys.executable, "-c", READER, path],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              text=True))
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError("a reader did not start")
            before = self.proxy.counters()["bytes_down"]
            start = time.monotonic()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            seconds = [float(p.stdout.readline()) for p in procs]
            wall = time.monotonic() - start
            remote = self.proxy.counters()["bytes_down"] - before
            leases = daemon.client().stats().get("leases", {})
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            for proc, mountpoint in mounts:
                stop_mount(proc, mountpoint)
            daemon.stop()
        size = self.args.file_mib * MIB
        return {"case": name, "readers": readers, "leases": lease_timeout != "0",
                "remote_bytes": remote, "remote_over_file": remote / size, "wall_s": wall,
                "reader_s": seconds, "taken": leases.get("taken", 0),
                "saved": leases.get("saved", 0), "expired": leases.get("expired", 0),
                "lost": leases.get("lost", 0)}

    def _mount(self, case_dir: str, pod: str, socket: str) -> tuple[subprocess.Popen, str]:
        mountpoint = os.path.join(case_dir, f"mnt-{pod}")
        os.makedirs(mountpoint)
        config = os.path.join(case_dir, f"pod-{pod}.toml")
        with open(config, "w") as f:
            f.write(f'volume = "bench"\nsource = "s3://bench"\nmountpoint = "{mountpoint}"\n'
                    f'key_file = "{self.key}"\nsocket = "{socket}"\n'
                    f'block_size = "{self.args.block_mib}M"\n'
                    f'[storage_options]\nendpoint_url = "{self.proxy.endpoint}"\n'
                    f'key = "{ACCESS_KEY}"\nsecret = "{SECRET_KEY}"\n'
                    f'[storage_options.client_kwargs]\nregion_name = "{REGION}"\n')
        child, why = spawn(["mount", "--config", config], build_config(load_toml(config)),
                           os.path.join(case_dir, f"fsclient-{pod}.log"), detach=False)
        if child is None:
            raise RuntimeError(f"fsclient mount failed: {why}")
        return child, mountpoint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.leases",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--readers", type=int, default=4, help="cold readers at once (default 4)")
    p.add_argument("--file-mib", type=int, default=256, help="the file's size (default 256)")
    p.add_argument("--block-mib", type=int, default=4, help="block size (default 4)")
    p.add_argument("--rtt-ms", type=float, default=2.0,
                   help="round trip the proxy adds (default %(default)s ms)")
    p.add_argument("--workdir", default=tempfile.gettempdir(), help="scratch space")
    p.add_argument("--out", help="also write the rows to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench = Bench(args)
    rows = []
    try:
        bench.start()
        for leases in ("0", None):  # before (off), after (the daemon's default)
            tag = "off" if leases == "0" else "on"
            alone = bench.case(f"alone-{tag}", 1, leases)
            many = bench.case(f"many-{tag}", args.readers, leases)
            many["wall_over_alone"] = many["wall_s"] / alone["wall_s"]
            rows += [alone, many]
    finally:
        bench.stop()
    print(f"{'case':<10} {'readers':>7} {'remote/file':>11} {'wall s':>7} {'/alone':>7} "
          f"{'leases':>7} {'saved':>6} {'expired':>7}")
    for r in rows:
        ratio = f"{r['wall_over_alone']:.2f}" if "wall_over_alone" in r else "-"
        print(f"{r['case']:<10} {r['readers']:>7} {r['remote_over_file']:>11.3f} "
              f"{r['wall_s']:>7.2f} {ratio:>7} {r['taken']:>7} {r['saved']:>6} "
              f"{r['expired']:>7}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
