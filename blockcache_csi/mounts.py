"""The mounts the plugin keeps: publish, unpublish, take over at a start.

Each published target is one `fsclient mount` keeper (root: it opens
/dev/fuse and mounts) whose FUSE server runs as its volume's server uid
(`servers`) with no capabilities (`fsclient.keeper.privileges`). The
keeper restarts a server that dies, with no failed read; it runs in its own
session, so it outlives the plugin's process. A plugin that starts takes every live mount over: the
keeper there surrenders its connection (`fsclient.keeper.control`) to a new
keeper this plugin starts, so that no mount depends on a container that an
upgrade replaces. A target whose keeper is gone gets a new one (fsclient
recovers the dead mount point first). One lock per target serializes the
calls on it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from fsclient import keeper as fskeeper
from fsclient import mount as fsmount
from fsclient import mountpoint as mp
from fsclient.keeper import Credentials, hand_on, set_kernel_readahead, unmount_lazy

from .environment import ServerEnvironment, SourceCredentials
from .errors import CsiError
from .servers import ServerUsers
from .state import StateDir
from .volstats import StatfsWithDeadline, Usage
from .volumes import Publication, mount_command

log = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0  # a keeper's time to end once its mount is gone
ADOPT_WORKERS = 4
SURRENDER_TIMEOUT = 30.0  # a live keeper's time to answer `surrender`


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class Mounts:
    """The targets this node's plugin has published."""

    def __init__(self, state: StateDir, servers: ServerUsers, socket: str | None,
                 log_file: str | None, environment: ServerEnvironment | None = None):
        self.state = state
        self.servers = servers
        self.environment = environment or ServerEnvironment()  # what keepers run with
        self.socket = socket
        self.log_file = log_file  # where keepers and servers log (the plugin's stderr)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._children: dict[int, subprocess.Popen] = {}  # keepers started here, to reap
        self._statfs = StatfsWithDeadline()

    def _lock(self, target: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(target, threading.Lock())

    def _server(self, pub: Publication) -> Credentials:
        return self.servers.credentials(pub, self.socket)

    # publish

    def publish(self, pub: Publication, key: bytes,
                credentials: SourceCredentials | None = None) -> None:
        with self._lock(pub.target):
            known = self.state.load(pub.target)
            if known is not None:
                if not known.same_volume(pub) or self.state.key(pub.target) != key:
                    raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"{pub.target} is already published with volume "
                                   f"{known.volume_id}" + (
                                       " and other settings or key" if
                                       known.volume_id == pub.volume_id else "") +
                                   "; unpublish it first, or publish at another target path")
                if self._kept(pub.target):
                    return  # a repeated publish of the same volume
                log.warning("%s is recorded but has no keeper; mounting it again", pub.target)
            else:
                entry = mp.find_mount(pub.target)
                if entry is not None:
                    raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"{pub.target} already has a mount this plugin did not "
                                   f"make ({entry.source}, {entry.fstype}); unmount it or "
                                   f"publish at another target path")
            self._start(pub, key, credentials or SourceCredentials(),
                        remove_on_failure=known is None)

    def _start(self, pub: Publication, key: bytes, credentials: SourceCredentials,
               remove_on_failure: bool) -> None:
        """Record `pub`, then start its keeper and wait until the mount answers."""
        if mp.find_mount(pub.target) is None:  # a dead mount stays: fsclient recovers it
            os.makedirs(pub.target, 0o755, exist_ok=True)
        server = self._server(pub)
        self.state.save_credentials(pub.target, credentials)
        self.state.save(pub, key)
        argv, cfg, env = mount_command(pub, self.state.key_file(pub.target), self.socket,
                                       server, credentials, self.environment)
        child, why = fsmount.spawn(argv, cfg, self.log_file, detach=True, env=env)
        if child is None:
            if remove_on_failure:
                self.state.remove(pub.target)
            raise CsiError(grpc.StatusCode.INTERNAL,
                           f"mounting volume {pub.volume_id} ({pub.get('source')}) on "
                           f"{pub.target} failed: {why}")
        with self._guard:
            self._children[child.pid] = child
        # the server, not root, may not set the mount's readahead window
        set_kernel_readahead(os.stat(pub.target).st_dev, fsmount.KERNEL_READAHEAD_KB)
        log.info("published volume %s on %s (keeper %d)", pub.volume_id, pub.target, child.pid)

    @staticmethod
    def _keeper(target: str) -> int | None:
        try:
            return int(fskeeper.status(target)["keeper"])
        except (mp.MountError, KeyError, ValueError):
            return None

    def _kept(self, target: str) -> bool:
        return self._keeper(target) is not None

    # unpublish

    def unpublish(self, volume_id: str, target: str) -> None:
        with self._lock(target):
            known = self.state.load(target)
            if known is not None and known.volume_id != volume_id:
                raise CsiError(grpc.StatusCode.NOT_FOUND,
                               f"{target} holds volume {known.volume_id}, not {volume_id}; "
                               f"unpublish it with its own volume_id")
            keeper = self._keeper(target)
            for _ in range(8):  # mounts stacked on the target, ours on top
                if mp.find_mount(target) is None:
                    break
                try:
                    unmount_lazy(target)
                except OSError as exc:
                    raise CsiError(grpc.StatusCode.INTERNAL,
                                   f"cannot unmount {target}: {exc}") from None
            if keeper is not None:
                self._stop(keeper)
            self.state.remove(target)
            self._remove_target(target)
            log.info("unpublished volume %s from %s", volume_id, target)

    def _stop(self, pid: int) -> None:
        """Wait for keeper `pid` to end (its server ends with the mount); make it."""
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + STOP_TIMEOUT
            while time.monotonic() < deadline:
                if not self._running(pid):
                    return
                time.sleep(0.05)
            log.warning("keeper %d has not ended within %gs of its unmount", pid, STOP_TIMEOUT)

    def _running(self, pid: int) -> bool:
        with self._guard:
            child = self._children.get(pid)
        if child is not None and child.poll() is not None:
            with self._guard:
                self._children.pop(pid, None)
            return False
        return _alive(pid)

    @staticmethod
    def _remove_target(target: str) -> None:
        """The spec: the plugin deletes the target it created."""
        try:
            os.rmdir(target)
        except FileNotFoundError:
            pass
        except NotADirectoryError:
            os.unlink(target)
        except OSError as exc:
            raise CsiError(grpc.StatusCode.INTERNAL,
                           f"{target} is unmounted but cannot be removed: {exc.strerror}") \
                from None

    # stats

    def stats(self, volume_id: str, path: str) -> Usage:
        """`path`'s statfs and condition, within `volstats.DEADLINE` whatever
        its server does."""
        known = self.state.load(path)
        if known is None or known.volume_id != volume_id:
            raise CsiError(grpc.StatusCode.NOT_FOUND,
                           f"volume {volume_id} is not published at {path}")
        if mp.find_mount(path) is None:
            raise CsiError(grpc.StatusCode.NOT_FOUND,
                           f"volume {volume_id} is recorded at {path}, but nothing is mounted "
                           f"there")
        return self._statfs.usage(path)

    # after a restart

    def adopt(self) -> None:
        """Take every recorded mount over: a live keeper surrenders it to a new
        keeper of ours; a mount without one gets a new one."""
        with ThreadPoolExecutor(ADOPT_WORKERS, thread_name_prefix="adopt") as pool:
            list(pool.map(self._adopt, self.state.records()))

    def _adopt(self, pub: Publication) -> None:
        with self._lock(pub.target):
            keeper = self._keeper(pub.target)
            if keeper is not None:
                self._take_over(pub, keeper)
                if self._kept(pub.target):
                    return
            if mp.find_mount(pub.target) is None and not os.path.lexists(pub.target):
                log.info("forgetting %s: its target path is gone", pub.target)
                self.state.remove(pub.target)
                return
            key = self.state.key(pub.target)
            if key is None:
                log.error("cannot mount %s again: its key file %s is missing", pub.target,
                          self.state.key_file(pub.target))
                return
            log.warning("%s has no keeper; mounting volume %s there again", pub.target,
                        pub.volume_id)
            try:
                self._start(pub, key, self.state.credentials(pub.target),
                            remove_on_failure=False)
            except CsiError as exc:
                log.error("%s", exc.message)

    def _take_over(self, pub: Publication, keeper: int) -> None:
        """Have `keeper` surrender `pub`'s live mount to a new keeper of ours; if
        that fails before the new one acks, the old one serves on."""
        try:
            surrendered = fskeeper.surrender(pub.target, SURRENDER_TIMEOUT)
        except (OSError, ValueError) as exc:
            log.warning("%s stays with keeper %d, which did not surrender it: %s", pub.target,
                        keeper, exc)
            return
        try:
            server = self._server(pub)
            argv, cfg, env = mount_command(pub, self.state.key_file(pub.target), self.socket,
                                           server, self.state.credentials(pub.target),
                                           self.environment)
            passing = hand_on(surrendered.named())
            try:
                child, why = fsmount.spawn(argv, cfg, self.log_file, detach=True,
                                           passed=passing, env=env)
            finally:
                passing.close()
        except CsiError as exc:
            child, why = None, exc.message
        except OSError as exc:  # no descriptor left to pass them on, say
            child, why = None, str(exc)
        finally:
            surrendered.close()  # the new keeper has its own copies, or none is needed
        if child is None:
            log.error("taking %s over from keeper %d failed: %s", pub.target, keeper, why)
            return
        with self._guard:
            self._children[child.pid] = child
        log.info("took %s over from keeper %d: volume %s, keeper %d", pub.target, keeper,
                 pub.volume_id, child.pid)

    def reap(self) -> None:
        """Collect keepers that ended (and, as PID 1, any orphan)."""
        with self._guard:
            done = [pid for pid, child in self._children.items() if child.poll() is not None]
            for pid in done:
                del self._children[pid]
        if os.getpid() == 1:
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                pass
