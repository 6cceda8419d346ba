"""Workload `restarts`: what a reader of an fsclient mount sees when its server
is killed (SIGKILL) or restarted live (`fsclient restart`), against the same
reader with nothing happening, in one run.

    python -m bench.restarts [--kills 10] [--restarts 5] [--every 2.0] [--quiet 8.0]

The reader is `devtools.mountreader` (8 threads: a held file read at random
offsets with its pages dropped, relative opens from a working directory in
the mount, absolute opens, listings; every byte checked) over a warm cache.
Three phases, each with a fresh reader: `quiet` (nothing happens), `kills`
(the server SIGKILLed every `--every` seconds, the keeper starts another),
`restarts` (live restarts, back to back). For each: operations, failed,
wrong, the longest operation and those over a second (stalled), and for
kills and restarts the time from the kill (or the request) until a new server
serves. Targets: 0 failed and 0 wrong reads, the longest stall <= 2 s.
Results go to stdout and bench/results/restarts.json; the exit code is 0 when
the targets are met.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

from bench.fuse_vs_passthrough import RESULTS
from devtools.demo import Demo
from devtools.mountreader import serving
from fsclient import keeper as keeping

TARGET_STALL = 2.0


def make_remote(root: str) -> None:
    rng = random.Random(31)
    for d in range(4):
        os.makedirs(os.path.join(root, f"dir{d}"))
        for i in range(25):
            with open(os.path.join(root, f"dir{d}", f"f{i:03d}.bin"), "wb") as f:
                f.write(rng.randbytes(rng.choice((4 << 10, 100 << 10, 1 << 20))))
    with open(os.path.join(root, "big.bin"), "wb") as f:
        f.write(rng.randbytes(16 << 20))


def phase(demo: Demo, remote: str, name: str, action, count: int, every: float) -> dict:
    stop = os.path.join(demo.tmp, f"{name}.stop")
    reader = subprocess.Popen([sys.executable, "-m", "devtools.mountreader", demo.mountpoint,
                               remote, stop, "--cwd", "dir1"], stdout=subprocess.PIPE)
    takeovers = []
    try:
        time.sleep(every)
        for _ in range(count):
            takeovers.append(action())
            time.sleep(every)
        open(stop, "w").close()
        out, _ = reader.communicate(timeout=300)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    tally = json.loads(out)
    if takeovers:
        tally["takeover_max_s"] = round(max(takeovers), 3)
        tally["takeover_mean_s"] = round(sum(takeovers) / len(takeovers), 3)
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.restarts",
                                description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--restarts", type=int, default=5)
    p.add_argument("--every", type=float, default=2.0, help="seconds between kills")
    p.add_argument("--out", default=RESULTS, help="where restarts.json goes")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    args.delay = 0.002  # Demo's remote: 2 ms a request
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    demo = Demo(args)
    try:
        remote = os.path.join(demo.tmp, "remote")
        make_remote(remote)
        demo.start_daemon()
        demo.mount(demo.write_config(remote))
        mp = demo.mountpoint
        subprocess.run(["cat", *[os.path.join(dp, f) for dp, _, fs in os.walk(mp) for f in fs]],
                       stdout=subprocess.DEVNULL, check=True)  # a warm cache
        demo.wait_fills()

        def kill() -> float:
            old = serving(mp)
            t = time.monotonic()
            os.kill(old, signal.SIGKILL)
            serving(mp, other_than=old)
            return time.monotonic() - t

        def restart() -> float:
            t = time.monotonic()
            keeping.restart(mp)
            return time.monotonic() - t

        results = {"quiet": phase(demo, remote, "quiet", lambda: 0.0, 0, 4 * args.every),
                   "kills": phase(demo, remote, "kills", kill, args.kills, args.every),
                   "restarts": phase(demo, remote, "restarts", restart, args.restarts,
                                     args.every),
                   "load_avg": [round(x, 2) for x in os.getloadavg()]}
    finally:
        demo.cleanup()
    print(json.dumps(results, indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "restarts.json"), "w") as f:
        json.dump(results, f, indent=1)
    ok = all(results[k]["failed"] == {} and results[k]["wrong"] == 0
             for k in ("quiet", "kills", "restarts"))
    return 0 if ok and results["kills"]["worst"] <= TARGET_STALL else 1


if __name__ == "__main__":
    sys.exit(main())
