"""Real fsclient mounts for tests: the CLI in a subprocess, always cleaned up.

`FsclientMount.start()` runs `python -m fsclient.cli mount ... --foreground`
with the readiness pipe the background mode uses, so it returns once the mount
answers (or raises with the process's log). `stop()` sends SIGTERM, then
kills, then lazily unmounts whatever is left; fixtures call it in `finally`.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from devtools.procs import stop_process
from fsclient import keeper as keeping
from fsclient.keeper.fdstore import Passing

REPO = str(Path(__file__).resolve().parents[2])
READY_TIMEOUT = 60.0


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def fsclient(*args: str, timeout: float = 120.0, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI once (not in the background); returns the completed process."""
    return subprocess.run([sys.executable, "-m", "fsclient.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env(), cwd=REPO,
                          stdin=subprocess.DEVNULL, **kw)


def s3_config(path, server, endpoint: str | None = None) -> list[str]:
    """fsclient's `--config PATH`, written to `path`: the S3 storage options
    of `server` (a `devtools.s3server.S3Server`), reached at `endpoint` (a
    front before it) if given."""
    o = server.storage_options
    Path(path).write_text(
        f'[storage_options]\nendpoint_url = "{endpoint or o["endpoint_url"]}"\n'
        f'key = "{o["key"]}"\nsecret = "{o["secret"]}"\n'
        f'[storage_options.client_kwargs]\n'
        f'region_name = "{o["client_kwargs"]["region_name"]}"\n')
    return ["--config", str(path)]


def is_mounted(path: str) -> bool:
    path = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split(" ")[4] == path for line in f)


def force_unmount(path: str) -> None:
    if is_mounted(path):
        subprocess.run(["fusermount3", "-uz", path], capture_output=True, timeout=30)


class FsclientMount:
    """One `fsclient mount --foreground` subprocess on `mountpoint`."""

    def __init__(self, source: str, mountpoint: str, key_file: str, socket: str | None,
                 volume: str = "testvol", args: Sequence[str] = (), log_path: str | None = None,
                 own_session: bool = False, python: str = sys.executable,
                 environ: dict[str, str] | None = None):
        self.source = str(source)
        self.mountpoint = str(mountpoint)
        self.key_file = str(key_file)
        self.socket = socket
        self.volume = volume
        self.args = list(args)
        self.log_path = log_path or f"{self.mountpoint}.fsclient.log"
        self.proc: subprocess.Popen | None = None
        self.warnings: list[str] = []
        self.own_session = own_session  # a process group of its own, to kill as one
        # the interpreter and environment (one another uid may run: `--server-user`)
        self.python, self.environ = python, environ

    def argv(self) -> list[str]:
        a = [self.python, "-m", "fsclient.cli", "--log-level", "debug", "mount",
             self.source, self.mountpoint, "--volume", self.volume,
             "--key-file", self.key_file]
        if self.socket:
            a += ["--socket", self.socket]
        return a + self.args + ["--foreground"]

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start(self, passed: Passing | None = None) -> FsclientMount:
        """Mount (or keep the connection `passed`, `fdstore.hand_on`); raise
        RuntimeError with the reason and the log if not ready."""
        os.makedirs(self.mountpoint, exist_ok=True)
        passing = passed or Passing(self.environ or env())
        r, w = os.pipe()
        w = passing.clear(w)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv() + ["--ready-fd", str(w)],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                         env=passing.env, cwd=REPO,
                                         start_new_session=self.own_session,
                                         **passing.popen(w))
        os.close(w)
        try:
            status = self._wait_ready(r)
        finally:
            os.close(r)
        if status != "READY":
            self.stop()
            raise RuntimeError(f"fsclient did not mount {self.mountpoint}: {status}\n{self.log()}")
        return self

    def _wait_ready(self, r: int) -> str:
        deadline = time.monotonic() + READY_TIMEOUT
        buf = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], 0.5)
            if not ready:
                continue
            chunk = os.read(r, 4096)
            if not chunk:
                return f"exited with {self.proc.wait(10)}"
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith("WARN "):
                    self.warnings.append(text[5:])
                elif text == "READY" or text.startswith("ERROR"):
                    return text
        return "timed out"

    def stats(self) -> dict:
        """The mount's Volume stats, through the root's user.blockcache.stats xattr."""
        import json
        return json.loads(os.getxattr(self.mountpoint, "user.blockcache.stats"))

    def cached(self, rel: str, daemon) -> tuple[str, bytes]:
        """Read `rel` whole through the mount, so every block of it is in the
        daemon's cache: its path in the mount and its bytes."""
        path = os.path.join(self.mountpoint, rel)
        with open(path, "rb") as f:
            data = f.read()
        daemon.wait_idle()
        return path, data

    def kill9(self) -> None:
        """SIGKILL the keeper and its server (stopped first, the keeper can
        start no other), so the mount is left dead: it answers ENOTCONN."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                server = keeping.status(self.mountpoint)["server"]
            except Exception:  # no keeper answers: nothing more to kill
                server = None
            self.proc.send_signal(signal.SIGSTOP)
            if server:
                try:
                    os.kill(server, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.kill()
            self.proc.wait(10)
            deadline = time.monotonic() + 10
            while server and os.path.exists(f"/proc/{server}") and time.monotonic() < deadline:
                time.sleep(0.02)

    def stop(self) -> int | None:
        """SIGTERM, wait, SIGKILL; then lazily unmount anything left. Never raises."""
        code = stop_process(self.proc, 15)
        force_unmount(self.mountpoint)
        return code

    def __enter__(self) -> FsclientMount:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
