"""Leaving nothing behind under a test's dir, whatever happened: its FUSE
connections aborted, its mounts unmounted, its processes killed, and the
keeper hosts' memory cgroups removed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from contextlib import suppress

from tests.support.proc_files import mounts_under, own_processes

FUSECTL = "/sys/fs/fuse/connections"


def _abort_connections(base: str) -> None:
    """Abort the FUSE connections mounted under `base`: a server's page-cache
    storer (`fsclient.session.storer`) may wait uninterruptibly for a read
    that no server will answer once everything is killed at once."""
    if not os.listdir(FUSECTL):
        subprocess.run(["mount", "-t", "fusectl", "none", FUSECTL], capture_output=True,
                       timeout=30)
    with open("/proc/self/mountinfo") as f:
        devices = [line.split(" ")[2] for line in f if line.split(" ")[4].startswith(base + "/")
                   and " - fuse" in line]
    for device in devices:
        with suppress(OSError):
            with open(os.path.join(FUSECTL, device.split(":")[1], "abort"), "w") as f:
                f.write("1")


def cleanup(base: str, spare: tuple[int, ...] = ()) -> None:
    """Abort and unmount every FUSE mount under `base`, and kill every process
    of ours there but `spare`."""
    with suppress(OSError):
        _abort_connections(base)
    for path in sorted(mounts_under(base), reverse=True):
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
    for pid in own_processes(base):
        if pid in spare:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


HOST_CGROUPS = re.compile(r"\((keeper-[0-9a-f]+-)N\)")


def remove_keeper_cgroups(logs: str, timeout: float = 10.0) -> None:
    """The cgroups beside ours in the v1 memory hierarchy of the keeper hosts
    whose logs (`*.log`) are in `logs`, once the processes `cleanup` killed
    have left them (a host removes its own, but not when it is killed, nor
    those of keepers it left). Only those: another test's host may have just
    made one, empty until its keeper joins it."""
    prefixes = set()
    for name in os.listdir(logs) if os.path.isdir(logs) else []:
        if name.endswith(".log"):
            with open(os.path.join(logs, name), errors="replace") as f:
                prefixes.update(HOST_CGROUPS.findall(f.read()))
    if not prefixes:
        return
    with open("/proc/self/cgroup") as f:
        path = next((line.rstrip("\n").split(":", 2)[2] for line in f
                     if "memory" in line.split(":")[1].split(",")), None)
    if path is None:
        return
    base = "/sys/fs/cgroup/memory" + path
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for name in os.listdir(base) if os.path.isdir(base) else []:
            if name.startswith(tuple(prefixes)):
                try:
                    os.rmdir(os.path.join(base, name))
                except OSError:
                    left.append(name)
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.2)
