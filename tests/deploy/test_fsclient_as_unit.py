"""Mount a volume the way fsclient@.service does (see unit_runner).

Root bounded to CAP_SYS_ADMIN (no CAP_DAC_OVERRIDE), with the daemon's group
as a supplementary group and no_new_privs, runs the unit's ExecStart= with
the installed example volume config: the command must return only once the
mount answers (Type=forking), the mount must serve the source's bytes to
other users (allow_other) and fill the daemon's cache over the socket (which
only the supplementary group opens), log to the --log-file, recover the
dead mount a killed process leaves (Restart=), and unmount on SIGTERM
(systemctl stop).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.deploy import unit_runner
from tests.support.deploy.fsclient_unit import (
    INSTANCE,
    mount_process,
    mount_processes,
    unit_argv,
    volume_config,
)
from tests.support.deploy.unit_runner import SERVICE_GID, WAIT, is_mounted, setpriv
from tests.support.deploy.units import install, value

pytest.importorskip("blockcached", reason="the daemon package blockcached is not installed")
pytest.importorskip("fsclient.mount", reason="fsclient is not installed")
pytestmark = unit_runner.fuse_marks()

READER_UID = 4242     # a training job's user, reading through allow_other


def test_fsclient_started_like_the_unit_mounts_fills_and_unmounts():
    with unit_runner.scratch_root() as root:
        inst = install(root / "dest")
        daemon = unit_runner.start_daemon(inst, root)
        mnt = None
        try:
            daemon.notify.wait_for("READY")
            mnt, logdir, files = volume_config(inst, root, daemon.socket_path)
            logdir.mkdir()                      # ExecStartPre=
            unit = inst.unit("fsclient@.service")
            caps = tuple(value(unit, "CapabilityBoundingSet").split())
            # The daemon's user and group stand in for `blockcache`.
            groups = [SERVICE_GID for g in value(unit, "SupplementaryGroups").split()
                      if g == value(inst.unit("blockcached.service"), "Group")]
            argv = setpriv(0, 0, groups, unit_argv(inst, root), caps)

            def start() -> subprocess.CompletedProcess:
                return subprocess.run(argv, env={"PATH": os.environ["PATH"], "LANG": "C.UTF-8"},
                                      capture_output=True, text=True, timeout=100, cwd="/")

            check_mount(start, mnt, logdir, files, daemon)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- daemon log ---\n{daemon.log()}") from None
        finally:
            pid = mount_process(mnt) if mnt else None
            if pid:
                os.kill(pid, signal.SIGKILL)
            if mnt and is_mounted(mnt):
                subprocess.run(["fusermount3", "-uz", str(mnt)], timeout=WAIT)
            daemon.stop()


def started(start) -> None:
    """Run ExecStart= and check it succeeded."""
    r = start()
    # Type=forking: the command returns, 0, only once the mount answers.
    assert r.returncode == 0, r.stderr


def read_all(mnt: Path, files: dict) -> None:
    for name, data in files.items():
        reader = subprocess.run(setpriv(READER_UID, READER_UID, [], ["cat", str(mnt / name)]),
                                capture_output=True, timeout=WAIT)
        assert reader.returncode == 0, reader.stderr
        assert reader.stdout == data, name


def check_mount(start, mnt: Path, logdir: Path, files: dict, daemon) -> None:
    from blockcache_client.daemonclient.client import Client

    started(start)
    assert is_mounted(mnt)
    pid = mount_process(mnt)
    assert pid, "no fsclient process serves the mount"
    read_all(mnt, files)
    # Misses are handed to the daemon in the background, over the socket that
    # only the supplementary group opens.
    deadline = time.monotonic() + WAIT
    with Client(daemon.socket_path) as c:
        while c.stats()["entries"] < len(files) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.stats()["entries"] >= len(files), "fsclient's fills never reached the daemon"
    assert "mounted" in (logdir / f"{INSTANCE}.log").read_text()
    # A crash of fsclient (keeper and server: a keeper alone is replaced by its
    # server) leaves a dead mount; Restart= runs ExecStart= again, which must
    # recover it with the same limited privileges. (Stopped first: neither
    # can start a process meanwhile.)
    pids = mount_processes(mnt)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in pids:
            os.kill(p, sig)
    deadline = time.monotonic() + WAIT
    while mount_process(mnt) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert is_mounted(mnt), "expected the killed process to leave its mount behind"
    started(start)
    pid = mount_process(mnt)
    assert pid, "no fsclient process serves the mount after the restart"
    read_all(mnt, files)
    # systemctl stop: SIGTERM to the main process unmounts and ends it.
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + WAIT
    while (is_mounted(mnt) or mount_process(mnt)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_mounted(mnt), "SIGTERM did not unmount"
    assert mount_process(mnt) is None
