"""The units' SystemCallFilter= and RestrictAddressFamilies= let the real
programs make every call they make.

systemd applies the filter just before it executes ExecStart=; a call the
filter misses fails with EPERM (SystemCallErrorNumber=), which the program
would meet in some error path, days later. Here each program runs under
strace, the way its unit starts it: the daemon through startup, a metrics
scrape, a put, lookups, watchdog pings and SIGTERM; fsclient through mount,
reads and SIGTERM. Every system call made after executing the binary must pass the
unit's filter, as `systemd-analyze syscall-filter` expands it here.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.deploy import unit_runner
from tests.support.deploy.fsclient_unit import mount_process, unit_argv, volume_config
from tests.support.deploy.package_install import bin_dir
from tests.support.deploy.unit_runner import WAIT, put_block
from tests.support.deploy.units import install, values

pytest.importorskip("blockcached", reason="the daemon package blockcached is not installed")
pytestmark = [
    pytest.mark.skipif(unit_runner.available() is not None, reason=str(unit_runner.available())),
    pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace"),
    pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                       reason="needs systemd-analyze to expand the filter's groups"),
]

# Allowed whatever the filter says (systemd.exec(5), SystemCallFilter=).
ALWAYS_ALLOWED = {"execve", "exit", "exit_group", "getrlimit", "rt_sigreturn", "sigreturn"}
_CALL = re.compile(r"^(\d+)\s+(?:<\.\.\. )?([a-z_0-9]+)(?:\(| resumed>)")


@functools.cache
def expand(name: str) -> frozenset[str]:
    """System calls of one `@group` (recursively) or a single call."""
    if not name.startswith("@"):
        return frozenset({name})
    out = subprocess.run(["systemd-analyze", "syscall-filter", name], check=True,
                         capture_output=True, text=True, timeout=30).stdout
    calls: set[str] = set()
    for line in out.splitlines()[1:]:
        word = line.strip()
        if word and not word.startswith("#"):
            calls |= expand(word)
    return frozenset(calls)


def allowed_by(filters: list[str]) -> set[str]:
    """The allow list the SystemCallFilter= lines build, in systemd's order:
    the first line sets the mode; later `~` lines remove, plain lines add."""
    assert filters and not filters[0].startswith("~"), "expected an allow list first"
    allowed: set[str] = set()
    for line in filters:
        deny = line.startswith("~")
        names = set().union(*(expand(w) for w in line.lstrip("~").split()))
        allowed = allowed - names if deny else allowed | names
    return allowed | ALWAYS_ALLOWED


def calls_after_exec(trace: Path, main_pid: int | None, binary: str) -> dict[str, int]:
    """Call -> count, made by `main_pid` (None: whichever pid does it first)
    after it executed `binary`, and by every thread or child afterwards."""
    counts: dict[str, int] = {}
    started = False
    for line in trace.read_text(errors="replace").splitlines():
        m = _CALL.match(line)
        if not m:
            continue
        pid, name = int(m.group(1)), m.group(2)
        if (main_pid in (None, pid) and f'execve("{binary}",' in line
                and line.rstrip().endswith("= 0")):
            started = True
            continue
        if started:
            counts[name] = counts.get(name, 0) + 1
    assert started, f"the trace never shows {main_pid or 'a process'} executing {binary}"
    return counts


def socket_families(trace: Path) -> set[str]:
    """Address families of every socket(2) and socketpair(2) in the trace."""
    return set(re.findall(r"\bsocket(?:pair)?\((AF_[A-Z0-9]+)", trace.read_text(errors="replace")))


def test_daemon_makes_only_calls_its_unit_allows():
    with unit_runner.scratch_root() as root:
        inst = install(root / "dest")
        unit = inst.unit("blockcached.service")
        trace = root / "strace.out"
        daemon = unit_runner.start_daemon(
            inst, root, wrap=("strace", "-f", "-qq", "-o", str(trace), "--"), metrics=True)
        try:
            [pid] = daemon.notify.wait_for("READY")
            # The Prometheus endpoint's thread and its AF_INET socket count too.
            with urllib.request.urlopen(daemon.metrics_url(), timeout=WAIT) as r:
                assert b"blockcache_up 1" in r.read()
            ping = subprocess.run([str(bin_dir() / "blockcache-cli"), "ping"], capture_output=True,
                                  env={"BLOCKCACHE_SOCKET": daemon.socket_path}, timeout=WAIT)
            assert ping.returncode == 0, ping.stderr
            put_block(daemon.socket_path)
            daemon.notify.wait_for("WATCHDOG", count=2)
            subprocess.run(["kill", "-TERM", str(pid)], check=True, timeout=WAIT)
            daemon.notify.wait_for("STOPPING")
            assert daemon.proc.wait(timeout=WAIT) == 0, daemon.log()
        finally:
            daemon.stop()
        used = calls_after_exec(trace, pid, str(bin_dir() / "blockcached"))
        denied = sorted(set(used) - allowed_by(values(unit, "SystemCallFilter")))
        assert not denied, f"blockcached.service's SystemCallFilter= denies {denied} (EPERM)"
        assert {"flock", "fchmod", "rename", "fsync"} & set(used), "the trace looks empty"
        families = " ".join(values(unit, "RestrictAddressFamilies")).split()
        assert socket_families(trace) <= set(families), "RestrictAddressFamilies= is too tight"


def test_allowed_by_follows_systemds_order():
    chown = expand("@chown")
    assert chown and chown <= expand("@system-service")
    assert not chown & allowed_by(["@system-service", "~@privileged"])
    assert chown <= allowed_by(["@system-service", "~@privileged", "@chown"])


def test_fsclient_makes_no_call_its_unit_denies():
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.skip("needs /dev/fuse and fusermount3")
    with unit_runner.scratch_root() as root:
        inst = install(root / "dest")
        unit = inst.unit("fsclient@.service")
        filters = values(unit, "SystemCallFilter")
        assert all(f.startswith("~") for f in filters), "expected a deny list"
        denied = set().union(*(expand(w) for f in filters for w in f.lstrip("~").split()))
        daemon = unit_runner.start_daemon(inst, root)
        trace = root / "strace.out"
        mnt = tracer = None
        try:
            daemon.notify.wait_for("READY")
            mnt, logdir, files = volume_config(inst, root, daemon.socket_path)
            logdir.mkdir()
            argv = unit_runner.setpriv(0, 0, [unit_runner.SERVICE_GID], unit_argv(inst, root),
                                       tuple(values(unit, "CapabilityBoundingSet")[-1].split()))
            # strace ends when the last traced process (the mount) does.
            tracer = subprocess.Popen(["strace", "-f", "-qq", "-o", str(trace), "--", *argv],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env={"PATH": os.environ["PATH"], "LANG": "C.UTF-8"})
            deadline = time.monotonic() + WAIT
            while not (unit_runner.is_mounted(mnt) and mount_process(mnt)):
                assert time.monotonic() < deadline, "fsclient did not mount under strace"
                time.sleep(0.2)
            for name, data in files.items():
                assert (mnt / name).read_bytes() == data
            os.kill(mount_process(mnt), signal.SIGTERM)
            tracer.wait(timeout=WAIT)
        finally:
            if tracer and tracer.poll() is None:
                pid = mount_process(mnt) if mnt else None
                if pid:
                    os.kill(pid, signal.SIGKILL)
                tracer.kill()
                tracer.wait()
            if mnt and unit_runner.is_mounted(mnt):
                subprocess.run(["fusermount3", "-uz", str(mnt)], timeout=WAIT)
            daemon.stop()
        used = calls_after_exec(trace, None, str(bin_dir() / "fsclient"))
        assert {"mount", "read"} <= set(used), "the trace looks empty"
        hit = sorted(set(used) & denied)
        assert not hit, f"fsclient@.service's SystemCallFilter= denies {hit} (EPERM)"
        families = " ".join(values(unit, "RestrictAddressFamilies")).split()
        assert socket_families(trace) <= set(families), "RestrictAddressFamilies= is too tight"
