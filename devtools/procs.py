"""Ending the real processes tests and benchmarks start."""

from __future__ import annotations

import signal
import socket
import subprocess


def stop_process(proc: subprocess.Popen | None, grace: float = 5.0) -> int | None:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL; the exit code (None
    if there was no process). Never leaves the process running."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
