"""`blockcache-csi keepers`: the keeper host. It starts, stops, lists and
reaps the node's fsclient keepers, on request of the plugin (root only, by
SO_PEERCRED, on a 0600 socket in a 0700 dir). It is small and rarely changes,
so the keepers it holds outlive every restart, OOM kill and upgrade of the
plugin's container; each keeper runs in a cgroup of its own (`cgroups`).

At its start it takes over every keeper of the host it replaces
(`succession`), then renames its socket over that host's and writes its
ready file. At SIGTERM it stops listening and leaves its keepers as they are
(after a succession they have handed over already).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import stat
import threading
from typing import Any

from . import wire
from .cgroups import KeeperCgroups
from .children import Child, Children, SpawnError
from .retake import retake
from .succession import succeed
from .takeover import NoKeeper, Refused, Squatted, refusal, surrender_here

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
LOOP_INTERVAL = 0.2
REQUEST_TIMEOUT = 30.0  # an asker's time to send its request


class HostStartError(Exception):
    """The host cannot start; the message names the thing and the fix."""


def _subreaper() -> None:
    """Orphans (a keeper a server started when its keeper died) come to us."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("cannot become a subreaper: %s", os.strerror(ctypes.get_errno()))


class Host:
    def __init__(self, path: str, server_memory: int, ready_file: str | None = None):
        self.path = os.path.abspath(path)
        self.ready_file = ready_file
        self.children = Children(KeeperCgroups(server_memory), on_lost=self._on_lost)
        self.stop = threading.Event()
        self.listener: socket.socket | None = None
        self.ours: os.stat_result | None = None  # our socket's inode, once at `path`

    # the socket

    def _bind(self) -> str:
        """Listen at a name of our own beside `path`; renamed over it later."""
        folder = os.path.dirname(self.path)
        os.makedirs(folder, 0o700, exist_ok=True)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
            raise HostStartError(f"{folder} must be a directory owned by root, for the keeper "
                            f"host's socket; remove it or choose another --socket")
        if st.st_mode & 0o077:
            os.chmod(folder, 0o700)  # only root enters, whatever the socket's mode
        bound = f"{self.path}.{os.getpid()}.{os.urandom(4).hex()}"  # pids repeat across pods
        with contextlib.suppress(FileNotFoundError):
            os.unlink(bound)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind(bound)
        except OSError as exc:
            sock.close()
            raise HostStartError(f"cannot listen on {bound}: {exc.strerror or exc}; choose a "
                                 f"--socket in a writable dir, short enough for a unix "
                                 f"socket (108 bytes)") from None
        os.chmod(bound, 0o600)
        sock.listen(64)
        self.listener = sock
        return bound

    def replaced(self) -> bool:
        """Whether another host's socket is at `path` now (our successor's)."""
        if self.ours is None:
            return False
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != (self.ours.st_dev, self.ours.st_ino)

    # requests

    def _loop(self) -> None:
        assert self.listener is not None
        while not self.stop.is_set():
            if select.select([self.listener], [], [], LOOP_INTERVAL)[0]:
                try:
                    conn, _ = self.listener.accept()
                except OSError:
                    continue
                threading.Thread(target=self._serve, args=(conn,), name="request",
                                 daemon=True).start()
            self.children.reap()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(REQUEST_TIMEOUT)
            message, fds = wire.receive(conn)  # (read first: a refusal must reach it)
            try:
                wire.require_root(conn, "the asker")
            except wire.PeerRefused as exc:
                log.warning("%s", exc)
                wire.close_all(fds)
                with contextlib.suppress(OSError):
                    wire.send(conn, {"error": "only root may ask the keeper host"})
                return
            conn.settimeout(None)
            try:
                if (message or {}).get("op") == "surrender":
                    self._surrender(conn, message or {})
                    return
                for answer in self._answer(message or {}, fds):
                    wire.send(conn, answer)
            except OSError as exc:
                log.warning("the asker left before the answer: %s", exc)
            finally:
                wire.close_all(fds)

    def _answer(self, message: dict[str, Any], fds: list[int]) -> list[dict[str, Any]]:
        op = message.get("op")
        if op == "list":
            keepers = self.children.listing()
            return [*({"keeper": k} for k in keepers), {"ok": True, "count": len(keepers)}]
        if op in ("stop", "alive"):
            pid = message.get("pid")
            child = self.children.get(pid) if isinstance(pid, int) else None
            if op == "alive":
                return [{"alive": child is not None and child.running()}]
            if child is None:
                return [{"error": f"pid {pid} is no keeper of this host"}]
            return [{"ok": True, "ended": self.children.stop(child)}]
        if op == "spawn":
            return [self._spawn(message, fds)]
        return [{"error": f"unknown request {op!r}"}]

    def _surrender(self, conn: socket.socket, message: dict[str, Any]) -> None:
        """Ask a mount's keeper for its connection and send it on, for the
        asker's `spawn`: from here, where a keeper's pid is seen (`takeover`)."""
        mountpoint = message.get("mountpoint")
        if not (isinstance(mountpoint, str) and mountpoint.startswith("/")):
            wire.send(conn, {"error": "mountpoint must be an absolute path"})
            return
        try:
            surrendered = surrender_here(mountpoint)
        except (NoKeeper, Refused, Squatted) as exc:
            wire.send(conn, {"error": str(exc), "refusal": refusal(exc)})
            return
        try:
            named = surrendered.named()
            wire.send(conn, {"ok": True, "fds": [name for name, _ in named]},
                      [fd for _, fd in named])
        finally:
            surrendered.close()  # the asker has its copies, or the keeper serves on

    def _spawn(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        argv, env = message.get("argv"), message.get("env")
        mountpoint, names = message.get("mountpoint"), message.get("fds") or []
        if not (isinstance(argv, list) and argv and argv[0] == "mount"
                and all(isinstance(a, str) for a in argv)):
            return {"error": "argv must be an `fsclient mount` command line: [\"mount\", ...]"}
        if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in env.items())):
            return {"error": "env must map names to strings"}
        if not (isinstance(mountpoint, str) and mountpoint.startswith("/")):
            return {"error": "mountpoint must be an absolute path"}
        if len(names) != len(fds) or not all(isinstance(n, str) for n in names):
            return {"error": f"{len(fds)} descriptors came with {len(names)} names"}
        serving = self.children.serving(mountpoint)
        if serving is not None and not fds:
            return {"error": f"keeper {serving.pid} of this host serves {mountpoint} already"}
        child = Child(mountpoint, str(message.get("source", "")), argv, env)
        self.children.register(child)  # first: a successor's `list` sees it from now on
        if self.replaced():
            self.children.forget(child)
            return {"error": "this keeper host is being replaced; ask its successor",
                    "replaced": True}
        try:
            self.children.spawn(child, list(zip(names, fds)))
        except SpawnError as exc:
            return {"error": str(exc)}
        return {"pid": child.pid}

    def start_keeper(self, mountpoint: str, source: str, argv: list[str],
                     env: dict[str, str], named: list[tuple[str, int]]) -> int:
        """A keeper of ours for a mount whose connection was surrendered to us
        (`named`); its pid once its server serves. SpawnError if it fails."""
        child = Child(mountpoint, source, list(argv), dict(env))
        self.children.register(child)
        self.children.spawn(child, named)
        return child.pid

    def _on_lost(self, child: Child) -> None:
        threading.Thread(target=retake, args=(self, child), name="retake",
                         daemon=True).start()

    # life

    def run(self) -> int:
        for line in (self.children.cgroups.setup(),):
            log.info("%s", line)
        _subreaper()
        bound = self._bind()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _f: self._on_signal(signum))
        loop = threading.Thread(target=self._loop, name="keepers", daemon=True)
        loop.start()
        try:
            succeed(self, bound)
            if self.ready_file and not self.stop.is_set():
                with open(self.ready_file, "w") as f:
                    f.write(f"{os.getpid()}\n")
            log.info("keeper host serving on %s", self.path)
            self.stop.wait()
        finally:
            self.stop.set()
            loop.join(5.0)
            self._leave(bound)
        return 0

    def publish(self, bound: str) -> None:
        """Rename our socket over `path`: no moment without a socket there."""
        os.rename(bound, self.path)
        self.ours = os.stat(self.path)

    def _on_signal(self, signum: int) -> None:
        log.info("%s: stopping; the keepers stay", signal.Signals(signum).name)
        self.stop.set()

    def _leave(self, bound: str) -> None:
        if self.listener is not None:
            self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(bound)  # (never renamed: stopped during the succession)
        if self.ours is not None and not self.replaced():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.ready_file)
        left = [k for k in self.children.listing() if k["pid"]]
        if left:
            log.info("leaving %d keepers running: %s", len(left),
                     ", ".join(f"{k['pid']} ({k['mountpoint']})" for k in left))
