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

from tests.deploy import unit_runner
from tests.deploy.package_install import bin_dir
from tests.deploy.unit_runner import SERVICE_GID, WAIT, is_mounted, setpriv
from tests.deploy.units import Installed, exec_start, install, value

pytest.importorskip("blockcached", reason="the daemon package blockcached is not installed")
pytest.importorskip("fsclient.mount", reason="fsclient is not installed")
pytestmark = unit_runner.fuse_marks()

INSTANCE = "imagenet"
READER_UID = 4242     # a training job's user, reading through allow_other


def volume_config(inst: Installed, root: Path, socket_path: str) -> tuple[Path, Path, dict]:
    """The installed example volume config, pointed at a local source under `root`."""
    source = root / "source"
    files = {f"train/{i:03d}.jpg": os.urandom(150_000 + i) for i in range(3)}
    for name, data in files.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    mnt = root / "mnt" / INSTANCE
    mnt.mkdir(parents=True)
    keys = root / "etc/blockcache/keys"
    keys.mkdir(parents=True, mode=0o700, exist_ok=True)
    subprocess.run([str(bin_dir() / "fsclient"), "keygen", str(keys / f"{INSTANCE}.key")],
                   check=True, capture_output=True, timeout=WAIT)
    text = (inst.etc / "volumes/volume.toml.example").read_text()
    lines = []
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip()
        if key == "source":
            line = f'source = "{source}"'
        elif key == "mountpoint":
            line = f'mountpoint = "{mnt}"'
        elif key == "key_file":
            line = f'key_file = "{keys / INSTANCE}.key"'
        elif key == "socket":
            line = f'socket = "{socket_path}"'
        elif key == "allow_other":
            line = "allow_other = true"
        elif line.startswith("[storage_options]") or key == "endpoint_url":
            continue            # a local source takes no S3 endpoint
        lines.append(line)
    conf = root / f"etc/blockcache/volumes/{INSTANCE}.toml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("\n".join(lines) + "\n")
    return mnt, root / "log", files


def unit_argv(inst: Installed, root: Path) -> list[str]:
    """ExecStart= of fsclient@INSTANCE.service with /etc and /var/log under `root`."""
    unit = inst.unit("fsclient@.service")
    pre = value(unit, "ExecStartPre").split()
    assert pre[:2] == ["/bin/mkdir", "-p"] and pre[2] == "/var/log/blockcache"
    return [a.replace("%i", INSTANCE).replace("/etc/blockcache/", f"{root}/etc/blockcache/")
            .replace("/var/log/blockcache/", f"{root}/log/") for a in exec_start(unit)]


def mount_process(mnt: Path) -> int | None:
    """Pid of the fsclient process serving `mnt` (what systemd guesses as MainPID)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--foreground" in cmd and any(str(mnt.parent.parent).encode() in c for c in cmd):
            return int(entry.name)
    return None



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
    # A crash leaves a dead mount; Restart= runs ExecStart= again, which must
    # recover it with the same limited privileges.
    os.kill(pid, signal.SIGKILL)
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
