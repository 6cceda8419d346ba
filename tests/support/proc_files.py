"""What /proc says of processes and mounts: a process's status, environment,
peak memory, children and liveness, the processes started under a dir, and
the mounts under one."""

from __future__ import annotations

import os
import time


def status_of(pid: int) -> dict[str, str]:
    """/proc/PID/status as a dict."""
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


def environ_of(pid: int) -> dict[str, str]:
    """/proc/PID/environ as a dict."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.partition(b"=") for item in f.read().split(b"\0") if item]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def peak_rss_kib(pid: int) -> int:
    """VmHWM (peak resident set) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for pid {pid}")


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if int(status_of(int(name))["PPid"]) == pid:
                    out.append(int(name))
            except (OSError, KeyError):
                pass
    return out


def own_processes(marker: str) -> list[int]:
    """Pids whose command line holds `marker` (our unique tmp dir)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(name))
        except OSError:
            pass
    return out


def dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"Z"
    except OSError:
        return True


def wait_dead(pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not dead(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} still runs after {timeout:g}s")
        time.sleep(0.05)


def mounts_under(base: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split(" ")[4] for line in f]
    return [p for p in points if p.startswith(base + "/")]
