"""Helpers for keeper tests: find the serving server, kill it, and a verifying
reader (devtools.mountreader) in its own process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from devtools import mountreader
from tests.fsclient.mounting import REPO, env

RESUME = 30.0  # a hang bound, not a speed target (bench/ has the stall figures)


def serving(mountpoint: str, other_than: int = 0) -> int:
    """The server pid once a server other than `other_than` serves."""
    return mountreader.serving(mountpoint, other_than, RESUME)


class Reader:
    """devtools.mountreader in its own process; `finish` returns its tally."""

    def __init__(self, mountpoint: str, source: str, tmp_path, cwd: str = "dir0"):
        self.stop = str(tmp_path / "reader.stop")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "devtools.mountreader", mountpoint, str(source), self.stop,
             "--cwd", cwd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(), cwd=REPO)

    def finish(self) -> dict:
        open(self.stop, "w").close()
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err.decode()
        return json.loads(out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def kill_server(mountpoint: str) -> int:
    pid = serving(mountpoint)
    os.kill(pid, signal.SIGKILL)
    return pid
