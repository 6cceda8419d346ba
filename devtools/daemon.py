"""A real `blockcached` process for tests: `DaemonProcess` and helpers.

    with DaemonProcess(tmp_path) as d:          # one 1G dir at tmp_path/cache
        d.client().put(key, blob)

The daemon runs as `python -m blockcached` in a subprocess, on a socket under
`tmp_path`, with `--min-free-bytes 0 --min-free-inodes 0` so tests do not
depend on how full the test machine's disk is (pass other values in
`extra_args` to test the floor). `start()` waits until `ping` answers (and the
start-up scan is done) and raises with the daemon's stderr if it does not
answer within 10 s.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from blockcache_client.contract.errors import BlockcacheError
from blockcache_client.daemonclient.client import Client
from devtools.procs import stop_process

START_TIMEOUT = 10.0
REBUILD_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
_DEFAULT_ARGS = ("--min-free-bytes", "0", "--min-free-inodes", "0")


class DaemonProcess:
    """One blockcached subprocess on a socket under `tmp_path`."""

    def __init__(self, tmp_path: os.PathLike | str,
                 cache_dirs: Sequence[tuple[os.PathLike | str, str]] | None = None,
                 extra_args: Sequence[str] = (),
                 nofile_soft: int | None = None):
        """`nofile_soft`: the daemon starts with this soft open-files limit
        (set in the child only, so the test process keeps its own)."""
        self.tmp_path = Path(tmp_path)
        self.nofile_soft = nofile_soft
        if cache_dirs is None:
            cache_dirs = [(self.tmp_path / "cache", "1G")]
        self.cache_dirs = [str(Path(p).absolute()) for p, _ in cache_dirs]
        self._sizes = [s for _, s in cache_dirs]
        self.socket_path = str(self.tmp_path / "blockcached.sock")
        self.extra_args = list(extra_args)
        self.log_path = self.tmp_path / f"blockcached.{id(self)}.log"
        self.proc: subprocess.Popen | None = None
        self._clients: list[Client] = []

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "blockcached", "--socket", self.socket_path]
        for path, size in zip(self.cache_dirs, self._sizes):
            args += ["--cache-dir", f"{path}:{size}"]
        return args + list(_DEFAULT_ARGS) + self.extra_args

    def _limits(self) -> None:
        if self.nofile_soft is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(self.nofile_soft, hard), hard))

    def start(self, wait_rebuilt: bool = True) -> DaemonProcess:
        """Spawn the daemon and wait until it answers `ping` and (unless told
        not to) has finished its start-up scan: until then it answers puts with
        `rebuilding` and lookups of existing blocks with misses."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("daemon already running")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=_repo_root(), env=_env(), preexec_fn=self._limits)
        deadline = time.monotonic() + START_TIMEOUT
        probe = Client(self.socket_path, timeout=1.0)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"blockcached exited with {self.proc.returncode} at start:\n"
                                       f"{self.stderr()}")
                try:
                    probe.ping()
                    break
                except BlockcacheError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"blockcached did not answer ping within "
                                       f"{START_TIMEOUT}s:\n{self.stderr()}")
                time.sleep(0.02)
        finally:
            probe.close()
        if wait_rebuilt:
            self.wait_rebuilt(timeout=REBUILD_TIMEOUT)
        return self

    def stderr(self) -> str:
        """Everything the daemon logged so far (all of its runs)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _close_clients(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()

    def stop(self) -> int | None:
        """SIGTERM, wait, then SIGKILL. Returns the exit code."""
        self._close_clients()
        if self.proc is None:
            return None
        code = stop_process(self.proc, STOP_TIMEOUT)
        self._log.close()
        return code

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self._close_clients()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None:
            self._log.close()

    def restart(self) -> DaemonProcess:
        self.stop()
        return self.start()

    def client(self, timeout: float = 5.0) -> Client:
        """A new blocking client on the daemon's socket (closed at stop)."""
        c = Client(self.socket_path, timeout=timeout)
        self._clients.append(c)
        return c

    def wait_rebuilt(self, timeout: float = 10.0) -> dict:
        """Wait until the rebuild scan is done; returns the stats map."""
        return self.wait_stats(lambda s: s["rebuild"]["state"] == "done", timeout)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until the rebuild is done and every queued put is written."""
        return self.wait_stats(lambda s: s["rebuild"]["state"] == "done"
                               and s["queue"]["entries"] == 0, timeout)

    def wait_stats(self, cond, timeout: float = 10.0, interval: float = 0.02,
                   client: Client | None = None) -> dict:
        """Poll `stats` every `interval` s until `cond(stats)`; on `client`'s
        connection if given (kept open), else on a new one."""
        c = client or Client(self.socket_path)
        try:
            deadline = time.monotonic() + timeout
            while True:
                s = c.stats()
                if cond(s):
                    return s
                if time.monotonic() > deadline:
                    raise TimeoutError(f"daemon stats never matched: {s}")
                time.sleep(interval)
        finally:
            if client is None:
                c.close()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = _repo_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("NOTIFY_SOCKET", None)
    env.pop("WATCHDOG_USEC", None)
    return env
