"""fsclient@.service's parts for the tests that run it: the example volume
config pointed at a local source, the unit's ExecStart= under a scratch root,
and the mount's serving process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.deploy.package_install import bin_dir
from tests.support.deploy.unit_runner import WAIT
from tests.support.deploy.units import Installed, exec_start, value

INSTANCE = "imagenet"


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


def mount_processes(mnt: Path) -> list[int]:
    """Pids of the fsclient processes of `mnt`, its keeper first (the oldest:
    what systemd guesses as MainPID), then its server."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--foreground" in cmd and any(str(mnt.parent.parent).encode() in c for c in cmd):
            pids.append(int(entry.name))
    return sorted(pids)


def mount_process(mnt: Path) -> int | None:
    """Pid of the fsclient process serving `mnt` (what systemd guesses as MainPID)."""
    pids = mount_processes(mnt)
    return pids[0] if pids else None
