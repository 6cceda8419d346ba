"""Readers that get no signal, watched for hung reads: the hang tests of older
kernels (no FUSE_NOTIFY_RESEND), where a request a server read and left
unanswered is never answered.

Each reader is a process of its own (`python -m tests.support.hangwatch MOUNT
SOURCE PROGRESS STOPFILE`) with one thread, no signal handler, and no signal
sent to it, as a DataLoader worker: it reads and verifies files in a loop, the
even ones each a fresh open of a random file read whole (lookups, opens, reads),
the odd ones preads of a held file with its pages dropped first (a steady stream
of reads, each reaching the server). Before each operation
it writes the CLOCK_MONOTONIC time it started to its PROGRESS file (0 once
done); the test's `Readers.watch` fails any operation older than BOUND, by
name, however long the test may run.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import time
from contextlib import suppress

BOUND = 60.0  # a hang bound, not a speed target
_PROGRESS = struct.Struct("<dQ")  # the running operation's start (0: none), ops done


class Readers:
    """`count` reader processes on `mountpoint`, verifying against `source`."""

    def __init__(self, mountpoint: str, source: str, tmp_path, count: int = 4):
        from tests.support.fsclient_mounts import REPO, env

        self.mountpoint = mountpoint
        self.stop_file = str(tmp_path / "readers.stop")
        self.progress = [str(tmp_path / f"reader{i}.progress") for i in range(count)]
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "tests.support.hangwatch", mountpoint, str(source), p,
             self.stop_file, str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env(), cwd=REPO) for i, p in enumerate(self.progress)]

    def _state(self, i: int) -> tuple[float, int]:
        try:
            with open(self.progress[i], "rb") as f:
                return _PROGRESS.unpack(f.read(_PROGRESS.size))
        except (OSError, struct.error):
            return 0.0, 0

    def done(self) -> list[int]:
        return [self._state(i)[1] for i in range(len(self.procs))]

    def watch(self, seconds: float) -> None:
        """For `seconds`, fail (AssertionError) as soon as a reader's operation
        has run BOUND seconds, or a reader has exited."""
        end = time.monotonic() + seconds
        while True:
            self._check()
            if time.monotonic() >= end:
                return
            time.sleep(0.2)

    def _check(self, stopping: bool = False) -> None:
        now = time.monotonic()
        for i, proc in enumerate(self.procs):
            started, ops = self._state(i)
            assert not started or now - started < BOUND, \
                f"reader {i} has waited {now - started:.0f}s for one read ({ops} done before)"
            if not stopping:
                assert proc.poll() is None, f"reader {i} exited: {proc.stderr.read().decode()}"

    def finish(self) -> list[dict]:
        """Stop the readers (each after its operation, still watched) and their
        tallies."""
        open(self.stop_file, "w").close()
        while any(p.poll() is None for p in self.procs):
            self._check(stopping=True)
            time.sleep(0.2)
        tallies = []
        for i, p in enumerate(self.procs):
            out, err = p.communicate()
            assert p.returncode == 0, f"reader {i}: {err.decode()}"
            tallies.append(json.loads(out))
        return tallies

    def kill(self) -> None:
        """Kill what is left, never raising. A reader held in a request no one
        answers dies once that request ends: now if fusectl can abort the
        connection, else when the mount's processes are stopped (which closes it)."""
        from fsclient import mountpoint as mp

        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                entry = mp.find_mount(self.mountpoint)
                if entry is not None:
                    with suppress(OSError), open(
                            f"/sys/fs/fuse/connections/{os.minor(entry.device)}/abort", "w") as f:
                        f.write("1")


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            path = os.path.join(d, n)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = f.read()
    return out


def main() -> None:
    mount, source, progress, stop_file, seed = sys.argv[1:6]
    truth = _files(source)
    names = sorted(truth)
    big = max(names, key=lambda n: len(truth[n]))
    rng = random.Random(int(seed))
    out = os.open(progress, os.O_RDWR | os.O_CREAT, 0o644)
    held = os.open(os.path.join(mount, big), os.O_RDONLY)
    ok = wrong = 0
    failed: dict[str, int] = {}
    worst = 0.0

    def whole(name: str) -> bool:
        with open(os.path.join(mount, name), "rb") as f:
            return f.read() == truth[name]

    def held_read(off: int) -> bool:
        os.posix_fadvise(held, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.pread(held, 65536, off) == truth[big][off:off + 65536]

    while not os.path.exists(stop_file):
        for op, arg in ((held_read, rng.randrange(len(truth[big]))) if int(seed) % 2 else
                        (whole, rng.choice(names)),):
            started = time.monotonic()
            os.pwrite(out, _PROGRESS.pack(started, ok + wrong + sum(failed.values())), 0)
            try:
                right = op(arg)
            except OSError as exc:
                key = f"{op.__name__}: {exc.strerror or exc.errno}"
                failed[key] = failed.get(key, 0) + 1
            else:
                ok += right
                wrong += not right
            worst = max(worst, time.monotonic() - started)
            os.pwrite(out, _PROGRESS.pack(0.0, ok + wrong + sum(failed.values())), 0)
    os.close(held)
    print(json.dumps({"ok": ok, "wrong": wrong, "failed": failed, "worst": round(worst, 3)}),
          flush=True)


if __name__ == "__main__":
    main()
