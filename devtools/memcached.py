"""Real `memcached` servers on loopback ports for tests and bench.

    with MemcachedProcess(memory_mb=64) as m:   # 127.0.0.1:<free port>
        m.address                               # "127.0.0.1:PORT"
        m.stall(); m.resume(); m.kill()

Each server listens on 127.0.0.1 only (UDP off), on a port the kernel picked
free a moment before. `start()` waits until it answers `version`; `stop()`
resumes a stalled server first, then SIGTERM/SIGKILL: none is left behind.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time

from devtools.procs import free_port, stop_process

START_TIMEOUT = 10.0


def _state(pid: int) -> str:
    """The process's state letter (R, S, T = stopped, ...) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def memcached_binary() -> str | None:
    # /usr/bin is where Debian puts it, even when PATH lacks it
    return shutil.which("memcached") or shutil.which("memcached", path="/usr/bin")


class MemcachedProcess:
    """One memcached subprocess on 127.0.0.1."""

    def __init__(self, memory_mb: int = 64, port: int | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.memory_mb = memory_mb
        self.port = port or free_port()
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self.stalled = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> MemcachedProcess:
        binary = memcached_binary()
        if binary is None:
            raise RuntimeError("memcached is not installed: run `make sysdeps` (Debian "
                               "package memcached)")
        # -U 0: no UDP; -u root: memcached refuses to run as root without it
        argv = [binary, "-l", "127.0.0.1", "-p", str(self.port), "-U", "0",
                "-m", str(self.memory_mb), "-t", "2", "-u", "root", *self.extra_args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"memcached exited with {self.proc.returncode}: "
                                   f"{self.proc.stderr.read().decode(errors='replace')}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    if "-Z" in self.extra_args:  # TLS only: listening is all we can see
                        return self
                    s.sendall(b"version\r\n")
                    if s.recv(64).startswith(b"VERSION"):
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"memcached on port {self.port} did not answer within "
                                   f"{START_TIMEOUT}s")
            time.sleep(0.02)

    def stall(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing answers.
        Returns once it is stopped (kill(2) only queues the signal: a busy
        server could still answer a request sent right after it)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.stalled = True
        deadline = time.monotonic() + START_TIMEOUT
        while _state(self.proc.pid) not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.001)

    def resume(self) -> None:
        if self.proc is not None and self.stalled and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.stalled = False

    def kill(self) -> None:
        """SIGKILL, as a crashed host would."""
        self.resume()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        self.resume()
        stop_process(self.proc)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def stats(self) -> dict[str, str]:
        """The server's `stats` (curr_items, evictions, ...)."""
        out = {}
        with socket.create_connection(("127.0.0.1", self.port), timeout=2.0) as s:
            s.sendall(b"stats\r\n")
            buf = b""
            while not buf.endswith(b"END\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        for line in buf.decode().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "STAT":
                out[parts[1]] = parts[2]
        return out

    def __enter__(self) -> MemcachedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
