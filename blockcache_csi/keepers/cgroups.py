"""A cgroup of its own for each keeper the host starts (its server and any
keeper that server starts with it), with a memory limit: one server's OOM
kill then stays inside that cgroup (the keeper restarts the server) and never
reaches the container's limit, where the kubelet's memory.oom.group=1 would
kill every keeper of the node.

- cgroup v2 (the host's own cgroup has the memory controller): the host moves
  itself into a leaf `host` (a v2 cgroup with controllers enabled for its
  children holds no process), enables `+memory` for the children, and makes
  `keeper-…` with memory.max and memory.oom.group=0 (kill the server alone).
  It also writes memory.oom.group=0 on its own cgroup (the container's), so a
  container-wide OOM kills the largest process (a server), not all of them.
- cgroup v1: `keeper-…` beside nothing else under the host's memory cgroup,
  with memory.limit_in_bytes.
- neither writable: logged once; keepers start in the host's cgroup.

A child joins its cgroup itself, between fork and exec (`join`), so nothing
it allocates is charged elsewhere.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import secrets

log = logging.getLogger(__name__)


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root, mount point, fstype, super options) of each mount of this process."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            tail = fields[fields.index("-") + 1:]
            out.append((fields[3], fields[4], tail[0], tail[2] if len(tail) > 2 else ""))
    return out


def _own_paths() -> tuple[str | None, str | None]:
    """This process's cgroup path in the v2 hierarchy and in v1's memory one."""
    v2 = v1 = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "":
                v2 = path
            elif "memory" in controllers.split(","):
                v1 = path
    return v2, v1


def _under(mount_root: str, mount_point: str, path: str) -> str | None:
    """Where cgroup `path` is in a hierarchy mounted at `mount_point` (None if
    that mount does not show it)."""
    if path != mount_root and not path.startswith(mount_root.rstrip("/") + "/"):
        return None
    return os.path.join(mount_point, os.path.relpath(path, mount_root))


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


class KeeperCgroups:
    """Makes and removes the keepers' cgroups; `limit` bytes each (0: none)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kind = ""  # "v2", "v1", or "" (none)
        self.base = ""
        self._token = secrets.token_hex(4)  # two hosts may share a cgroup (tests, a surge)
        self._numbers = itertools.count(1)
        self._made: set[str] = set()  # ours, until removed

    @property
    def prefix(self) -> str:
        """The start of this host's keeper cgroups' names (a number follows)."""
        return f"keeper-{self._token}-"

    def setup(self) -> str:
        """Find where keepers' cgroups can go; a line saying what was found."""
        v2_path, v1_path = _own_paths()
        for root, point, fstype, _options in _mounts():
            if fstype == "cgroup2" and v2_path is not None and not self.kind:
                where = _under(root, point, v2_path)
                if where and "memory" in _read(os.path.join(where, "cgroup.controllers")).split():
                    why = self._setup_v2(where)
                    if not why:
                        return (f"keepers get cgroup v2 groups under {self.base} "
                                f"({self.prefix}N)")
                    log.warning("cannot use cgroup v2 at %s: %s", where, why)
        for root, point, fstype, options in _mounts():
            if fstype == "cgroup" and "memory" in options.split(",") and v1_path is not None:
                where = _under(root, point, v1_path)
                if where and os.access(where, os.W_OK):
                    self.kind, self.base = "v1", where
                    return (f"keepers get cgroup v1 memory groups under {self.base} "
                            f"({self.prefix}N)")
        return ("no writable memory cgroup (v2 with the memory controller, or v1's memory "
                "hierarchy): keepers start in the host's own cgroup, with no limit of their "
                "own; mount the cgroup fs read-write (a privileged container) to have one")

    def _setup_v2(self, where: str) -> str:
        try:
            _write(os.path.join(where, "memory.oom.group"), "0")
        except OSError as exc:
            log.warning("memory.oom.group of %s stays as it is (%s): an OOM of the whole "
                        "container kills every keeper", where, exc)
        subtree = os.path.join(where, "cgroup.subtree_control")
        if "memory" not in _read(subtree).split():
            try:
                leaf = os.path.join(where, "host")
                os.makedirs(leaf, exist_ok=True)
                _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
                _write(subtree, "+memory")
            except OSError as exc:
                return f"{exc.strerror} (other processes in the host's cgroup?)"
        self.kind, self.base = "v2", where
        return ""

    def make(self) -> str | None:
        """A new keeper's cgroup, limits set; None without cgroups (or if it fails)."""
        if not self.kind:
            return None
        path = os.path.join(self.base, f"{self.prefix}{next(self._numbers)}")
        try:
            os.mkdir(path)
            self._made.add(path)
            if self.kind == "v2":
                _write(os.path.join(path, "memory.oom.group"), "0")
                _write(os.path.join(path, "memory.max"), str(self.limit) if self.limit else "max")
            elif self.limit:
                _write(os.path.join(path, "memory.limit_in_bytes"), str(self.limit))
        except OSError as exc:
            log.warning("cannot make the keeper's cgroup %s (%s); it starts without one",
                        path, exc)
            self.remove(path)
            return None
        return path

    def remove(self, path: str | None) -> None:
        """Remove a keeper's cgroup once empty (its server may still be handing
        over, its keeper still running: tried again by `sweep`)."""
        if path is None:
            return
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return
            log.warning("cannot remove cgroup %s: %s", path, exc)
        self._made.discard(path)

    def made(self) -> set[str]:
        return set(self._made)

    def sweep(self, ended: set[str] | None = None) -> None:
        """Remove the empty cgroups of ours (of `ended` keepers only, if given)."""
        for path in list(self._made if ended is None else ended & self._made):
            self.remove(path)


def join(path: str | None) -> None:
    """In the child between fork and exec: move this process into `path`."""
    if path is not None:
        fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
