"""Play systemd's part for the installed units, without systemd as PID 1.

What a unit's [Service] settings do before and around ExecStart= is done here
with plain tools: the notify socket (NOTIFY_SOCKET, with SO_PASSCRED so the
sender pid is known, as systemd checks for NotifyAccess=main), WATCHDOG_USEC
and WATCHDOG_PID, RuntimeDirectory=/CacheDirectory= owned by the service
user with their modes, UMask=, and User=/Group=/SupplementaryGroups=/
CapabilityBoundingSet=/NoNewPrivileges= through `setpriv`. Seccomp, device
and namespace settings need systemd itself; `systemd-analyze` checks those.

Host paths (/etc, /run, /var) are moved under a scratch root, by rewriting
the installed configs' paths.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.deploy.units import Installed, exec_start, value

SERVICE_UID = SERVICE_GID = 65534     # stands in for User=blockcache (nobody)
WATCHDOG_USEC = 1_000_000             # 1 s (the unit says 30 s) so pings come quickly
WAIT = 30.0


def available() -> str | None:
    """Why units cannot be played here, or None."""
    if os.geteuid() != 0:
        return "needs root to switch to the units' users"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux)"
    return None


def fuse_marks() -> list:
    """pytest marks for tests that play a unit or pod which mounts FUSE."""
    reason = available()
    return [pytest.mark.fuse,
            pytest.mark.skipif(reason is not None, reason=str(reason)),
            pytest.mark.skipif(not os.path.exists("/dev/fuse")
                               or shutil.which("fusermount3") is None,
                               reason="needs /dev/fuse and fusermount3")]


def is_mounted(path: Path) -> bool:
    """Whether `path` is a mount point in this mount namespace."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


@contextmanager
def scratch_root() -> Iterator[Path]:
    """A world-traversable temp dir (service users must reach into it)."""
    d = Path(tempfile.mkdtemp(prefix="blockcache-unit-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def setpriv(uid: int, gid: int, groups: list[int], argv: list[str],
            caps: tuple[str, ...] = ()) -> list[str]:
    """argv as uid/gid with only `groups`, capabilities bounded to `caps`, no_new_privs.

    For uid 0 the bounding set is what the process keeps (systemd's
    CapabilityBoundingSet=); any other uid has no capabilities at all.
    """
    grp = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    bound = ",".join(["-all", *(f"+{c.lower().removeprefix('cap_')}" for c in caps)])
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", *grp, "--inh-caps=-all",
            f"--bounding-set={bound}", "--no-new-privs", "--", *argv]


class NotifyListener:
    """The service manager's end of sd_notify: a datagram socket with SO_PASSCRED.

    It reads continuously, like systemd: a unix datagram queue holds only a
    few messages (net.unix.max_dgram_qlen, 10 by default), and a sender
    blocks once it is full.
    """

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o777)           # like /run/systemd/notify: any uid may send
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[int, dict[str, str]]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="notify", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed:
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                continue
            except OSError:
                return
            pid = next(struct.unpack("iII", d)[0] for lvl, typ, d in anc
                       if lvl == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS)
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cv:
                self.messages.append((pid, fields))
                self._cv.notify_all()

    def wait_for(self, field: str, count: int = 1, timeout: float = WAIT) -> list[int]:
        """Wait until `count` messages have set `field`; returns their sender pids."""
        with self._cv:
            if not self._cv.wait_for(lambda: len(self.senders(field)) >= count, timeout):
                raise AssertionError(f"no {count}x {field} within {timeout}s; got {self.messages}")
            return self.senders(field)

    def senders(self, field: str) -> list[int]:
        return [pid for pid, f in self.messages if field in f]

    def close(self) -> None:
        self._closed = True
        self._reader.join(timeout=2)
        self.sock.close()


@dataclass
class DaemonService:
    """blockcached.service, started by `start_daemon`."""

    proc: subprocess.Popen
    notify: NotifyListener
    run_dir: Path
    cache_dir: Path
    socket_path: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics_url(self, timeout: float = WAIT) -> str:
        """The /metrics URL the daemon logged it serves."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"serving metrics on (http://\S+/metrics)", self.log())
            if m:
                return m.group(1)
            time.sleep(0.1)
        raise AssertionError(f"the daemon did not log a metrics endpoint:\n{self.log()}")

    def stop(self) -> None:
        """Make sure the daemon is gone (killed if still running), and with a
        wrapper (strace) its tracees too, which outlive a killed tracer."""
        if self.proc.poll() is None:
            for pid in descendants(self.proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.kill()
            self.proc.wait()
        self.notify.close()


def descendants(pid: int) -> list[int]:
    """Pids of every process below `pid` (from /proc/PID/task/*/children)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *descendants(child)]
    return out


def start_daemon(inst: Installed, root: Path, wrap: tuple[str, ...] = (),
                 metrics: bool = False) -> DaemonService:
    """Start the installed blockcached.service's ExecStart= as systemd would
    (under `wrap`, e.g. strace, if given: then `proc` is the wrapper), with
    its Prometheus endpoint on a free loopback port if `metrics`."""
    unit = inst.unit("blockcached.service")
    argv = exec_start(unit)
    run_dir = root / "run" / value(unit, "RuntimeDirectory")
    cache_dir = root / "cache" / value(unit, "CacheDirectory")
    # The installed config, with the host paths moved under `root` and no
    # free-space floor (the test machine's disk may have less than 1G free).
    cfg_path = Path(argv[argv.index("--config") + 1])
    text = (inst.root / cfg_path.relative_to("/")).read_text()
    text = text.replace('"/run/blockcache/', f'"{run_dir}/').replace(
        '"/var/cache/blockcache"', f'"{cache_dir}"').replace(
        'min_free_bytes = "1G"', 'min_free_bytes = "0"').replace(
        "min_free_inodes = 10000", "min_free_inodes = 0")
    if metrics:    # a top-level key: before the first [[cache_dirs]] table
        text = 'metrics_addr = "127.0.0.1:0"\n' + text
    config = root / "blockcached.toml"
    config.write_text(text)
    argv[argv.index("--config") + 1] = str(config)
    for d, mode in ((run_dir, value(unit, "RuntimeDirectoryMode")),
                    (cache_dir, value(unit, "CacheDirectoryMode"))):
        d.mkdir(parents=True)
        os.chown(d, SERVICE_UID, SERVICE_GID)
        os.chmod(d, int(mode, 8))
    notify = NotifyListener(root / "notify")
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "NOTIFY_SOCKET": str(notify.path),
           "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    # systemd sets WATCHDOG_PID to the service's pid: here the shell's, which
    # `exec` hands on to setpriv and then to the daemon.
    launcher = [*wrap, "sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh",
                *setpriv(SERVICE_UID, SERVICE_GID, [], argv)]
    log_path = root / "blockcached.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(launcher, env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd="/", umask=int(value(unit, "UMask"), 8))
    return DaemonService(proc, notify, run_dir, cache_dir, str(run_dir / "blockcached.sock"),
                         log_path)


def put_block(socket_path: str) -> str:
    """Put one sealed block as a client would; its cached path once written."""
    from blockcache_client.contract import blockfile
    from blockcache_client.daemonclient.client import Client

    key = "imagenet_42_000000000000000000000000000000ab_0000000000000000"
    blob = blockfile.seal(key, os.urandom(100_000), os.urandom(32))
    deadline = time.monotonic() + WAIT
    with Client(socket_path) as c:
        while time.monotonic() < deadline:
            # Puts are refused until the startup scan of the dir is done.
            c.put(key, blob)
            paths = c.lookup([key])
            if paths and paths[0]:
                return paths[0]
            time.sleep(0.1)
    raise AssertionError(f"the daemon did not cache {key} within {WAIT}s")
