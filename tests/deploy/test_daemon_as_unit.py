"""Run the real daemon the way blockcached.service runs it.

No systemd PID 1 here, so the test plays its part: it binds the notify socket
(NOTIFY_SOCKET, credentials on, as systemd does), sets WATCHDOG_USEC and
WATCHDOG_PID, creates the RuntimeDirectory= and CacheDirectory= owned by the
service user, applies the unit's UMask=, and starts the unit's own ExecStart=
(from `make install-systemd`) as an unprivileged user with no capabilities
and no_new_privs, like User= + CapabilityBoundingSet= + NoNewPrivileges=.
It expects READY=1 from the main pid once the socket serves, watchdog pings,
and STOPPING=1 and exit status 0 on SIGTERM.

The seccomp and namespace settings need systemd itself; they are checked by
`systemd-analyze` in test_systemd_units.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.deploy.paths import BIN
from tests.deploy.units import exec_start, install, value

pytest.importorskip("blockcached", reason="the daemon package blockcached is not installed")

SERVICE_UID = SERVICE_GID = 65534     # stands in for User=blockcache (nobody)
OTHER_UID = 4242                      # a pod/user that is not in the socket's group
WATCHDOG_USEC = 1_000_000             # 1 s (the unit says 30 s) so pings come quickly
WAIT = 30.0

needs_root_tools = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv (util-linux) to run the daemon as the unit's user")


class NotifyListener:
    """The service manager's end of sd_notify: a datagram socket with SO_PASSCRED."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o777)           # like /run/systemd/notify: any uid may send
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages: list[tuple[int, dict[str, str]]] = []

    def wait_for(self, field: str, count: int = 1, timeout: float = WAIT) -> list[int]:
        """Receive until `count` messages set `field`; returns their sender pids."""
        deadline = time.monotonic() + timeout
        while len(self.senders(field)) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {count}x {field} within {timeout}s; got {self.messages}")
            self.sock.settimeout(left)
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except socket.timeout:
                continue
            pid = next(struct.unpack("iII", d)[0] for lvl, typ, d in anc
                       if lvl == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS)
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((pid, fields))
        return self.senders(field)

    def senders(self, field: str) -> list[int]:
        return [pid for pid, f in self.messages if field in f]

    def close(self) -> None:
        self.sock.close()


def as_user(uid: int, gid: int, groups: list[int], argv: list[str]) -> list[str]:
    """argv run as uid/gid with only `groups`, no capabilities, no_new_privs."""
    grp = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", *grp, "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--", *argv]


def cli(uid: int, groups: list[int], socket_path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(as_user(uid, uid, groups, [str(BIN / "blockcache-cli"), *args]),
                          env={"PATH": os.environ["PATH"], "BLOCKCACHE_SOCKET": socket_path},
                          capture_output=True, text=True, timeout=WAIT)


@pytest.fixture
def root():
    """A world-traversable scratch root (the service user must reach into it)."""
    d = Path(tempfile.mkdtemp(prefix="blockcache-unit-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@needs_root_tools
def test_daemon_started_like_the_unit_notifies_serves_and_stops(root):
    inst = install(root / "dest")
    unit = inst.unit("blockcached.service")
    argv = exec_start(unit)
    assert argv[0] == str(BIN / "blockcached")
    # The installed config, with the host paths moved under `root` and no
    # free-space floor (the test machine's disk may be fuller than 1G free).
    run_dir = root / "run" / value(unit, "RuntimeDirectory")
    cache_dir = root / "cache" / value(unit, "CacheDirectory")
    cfg_path = Path(argv[argv.index("--config") + 1])
    text = (inst.root / cfg_path.relative_to("/")).read_text()
    text = text.replace('"/run/blockcache/', f'"{run_dir}/').replace(
        '"/var/cache/blockcache"', f'"{cache_dir}"').replace('"1G"', '"0"').replace(
        "min_free_inodes = 10000", "min_free_inodes = 0")
    config = root / "blockcached.toml"
    config.write_text(text)
    argv[argv.index("--config") + 1] = str(config)
    socket_path = str(run_dir / "blockcached.sock")
    # What systemd prepares before ExecStart.
    for d, mode in ((run_dir, value(unit, "RuntimeDirectoryMode")),
                    (cache_dir, value(unit, "CacheDirectoryMode"))):
        d.mkdir(parents=True)
        os.chown(d, SERVICE_UID, SERVICE_GID)
        os.chmod(d, int(mode, 8))
    notify = NotifyListener(root / "notify")
    env = {"PATH": os.environ["PATH"], "NOTIFY_SOCKET": str(notify.path),
           "WATCHDOG_USEC": str(WATCHDOG_USEC), "LANG": "C.UTF-8"}
    # systemd sets WATCHDOG_PID to the service's pid: the shell's, which
    # `exec` hands on to setpriv and then to the daemon.
    launcher = ["sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh",
                *as_user(SERVICE_UID, SERVICE_GID, [], argv)]
    log = open(root / "daemon.log", "wb")
    proc = subprocess.Popen(launcher, env=env,
                            stdout=log, stderr=subprocess.STDOUT, cwd="/",
                            umask=int(value(unit, "UMask"), 8))
    try:
        run_checks(proc, notify, unit, run_dir, cache_dir, socket_path)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- daemon log ---\n"
                             f"{(root / 'daemon.log').read_text()}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
        log.close()


def run_checks(proc, notify, unit, run_dir, cache_dir, socket_path) -> None:
    """What systemd would see, and what clients and pods rely on."""
    ready_from = notify.wait_for("READY")
    # NotifyAccess=main: systemd only listens to the main pid.
    assert ready_from == [proc.pid], "READY=1 must come from the main process"
    # READY=1 means the socket serves: a peer in the socket's group (how
    # fsclient@.service connects, as root without CAP_DAC_OVERRIDE) gets
    # an answer, and a peer outside it is refused by the socket's mode.
    st = os.stat(socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == SERVICE_GID
    ok = cli(OTHER_UID, [SERVICE_GID], socket_path, "ping")
    assert ok.returncode == 0, ok.stderr
    refused = cli(OTHER_UID, [], socket_path, "ping")
    assert refused.returncode != 0 and refused.stderr.strip()
    # Blocks the daemon writes under the unit's umask are readable by
    # every pod (they mount the cache dir read-only and read directly).
    path = put_block(socket_path)
    for p in (Path(path), *Path(path).parents):
        if p == cache_dir:
            break
        assert stat.S_IMODE(p.stat().st_mode) == (0o644 if p == Path(path) else 0o755), p
    reader = subprocess.run(as_user(OTHER_UID, OTHER_UID, [], ["cat", path]),
                            capture_output=True, timeout=WAIT)
    assert reader.returncode == 0 and reader.stdout, reader.stderr
    # The event loop pings the watchdog every WATCHDOG_USEC/2.
    assert set(notify.wait_for("WATCHDOG", count=3)) == {proc.pid}
    proc.send_signal(signal.SIGTERM)
    notify.wait_for("STOPPING")
    assert proc.wait(timeout=WAIT) == 0
    assert not os.path.exists(socket_path)
    assert run_dir.is_dir(), "the daemon must leave its RuntimeDirectory in place"


def put_block(socket_path: str) -> str:
    """Put one sealed block as a client would; its cached path once written."""
    from blockcache_client import blockfile
    from blockcache_client.client import Client

    key = "imagenet_42_00000000000000ab_0000000000000000"
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
