"""Cold readers of one file, each a process of its own, started together:
for the tests of fetch leases (one fetch per block on the host).

    with Readers() as rs:
        rs.volume(name, url, key_file, socket, options, "f.bin")   # a Volume in a process
        rs.path("/mnt/a/f.bin")                                     # a plain read of a mount
        rs.wait_ready()
        rs.go()                                  # every reader starts its read now
        results = rs.results(timeout=60)         # [{"sha", "seconds", "stats"?}, ...]

Each child reads its file front to back in 1 MiB reads once told to go, and
prints what it read (its sha256), how long it took and (a `Volume`'s) its
stats as one JSON line. `kill(i)` SIGKILLs one; every child still running
is killed when the block ends.

    python -m tests.support.leasereaders volume NAME URL KEY SOCKET OPTIONS REL BLOCK_SIZE
    python -m tests.support.leasereaders path PATH
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
READ = 1 << 20


class Readers:
    """Reader processes (see the module); always killed at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self._lines: list[queue.Queue] = []  # each child's output lines, as they come

    def volume(self, name: str, url: str, key_file: str, socket: str, options: dict,
               rel: str, block_size: int) -> int:
        """A reader of `rel` through a `Volume` of its own; its index."""
        return self._start(["volume", name, url, key_file, socket, json.dumps(options), rel,
                            str(block_size)])

    def path(self, path: str) -> int:
        """A reader of a file (a FUSE mount's) by plain reads; its index."""
        return self._start(["path", path])

    def _start(self, args: list[str]) -> int:
        env = dict(os.environ, PYTHONPATH=REPO)
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.leasereaders", *args],
                                cwd=REPO, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
        self.procs.append(proc)
        self._lines.append(lines)
        return len(self.procs) - 1

    def wait_ready(self, which: list[int] | None = None, timeout: float = 30.0) -> None:
        for i in self._which(which):
            line = self._line(i, timeout)
            if line != "ready":
                raise RuntimeError(f"reader {i} did not start: {line!r}")

    def go(self, which: list[int] | None = None) -> float:
        """Tell the readers to read; the time (monotonic) they were told."""
        for i in self._which(which):
            self.procs[i].stdin.write("go\n")
            self.procs[i].stdin.flush()
        return time.monotonic()

    def results(self, which: list[int] | None = None, timeout: float = 60.0) -> list[dict]:
        out = []
        for i in self._which(which):
            line = self._line(i, timeout)
            try:
                out.append(json.loads(line))
            except ValueError:
                raise RuntimeError(f"reader {i} failed: {line!r}") from None
        return out

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(10)

    def _line(self, i: int, timeout: float) -> str:
        """The next line reader `i` printed, within `timeout` (else it is killed)."""
        try:
            return self._lines[i].get(timeout=timeout)
        except queue.Empty:
            self.procs[i].kill()
            raise TimeoutError(f"reader {i} printed nothing within {timeout:g}s") from None

    def _which(self, which: list[int] | None) -> list[int]:
        return list(range(len(self.procs))) if which is None else which

    def __enter__(self) -> Readers:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            try:
                p.stdin.close()
            except BrokenPipeError:  # it died with a line unread
                pass


def _pump(proc: subprocess.Popen, lines: queue.Queue) -> None:
    for line in proc.stdout:
        lines.put(line.strip())
    lines.put("(exited)")


def _read(f) -> str:
    h = hashlib.sha256()
    while True:
        b = f.read(READ)
        if not b:
            return h.hexdigest()
        h.update(b)


def main(argv: list[str]) -> None:
    if argv[0] == "path":
        print("ready", flush=True)
        sys.stdin.readline()
        start = time.monotonic()
        with open(argv[1], "rb") as f:
            sha = _read(f)
        print(json.dumps({"sha": sha, "seconds": time.monotonic() - start}), flush=True)
        return
    from blockcache_client import Volume
    name, url, key_file, socket, options, rel, block_size = argv[1:8]
    with Volume(name, url, key_file, socket_path=socket, block_size=int(block_size),
                **json.loads(options)) as vol:
        deadline = time.monotonic() + 10
        while not vol.stats()["daemon_connected"] and time.monotonic() < deadline:
            time.sleep(0.01)
        print("ready", flush=True)
        sys.stdin.readline()
        start = time.monotonic()
        with vol.open(rel) as f:
            sha = _read(f)
        seconds = time.monotonic() - start
        vol.wait_fills(10)
        print(json.dumps({"sha": sha, "seconds": seconds, "stats": vol.stats()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
