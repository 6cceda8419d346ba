"""The mounts the plugin keeps: publish, unpublish, keep at a start.

Each published target is one `fsclient mount` keeper (root: it opens
/dev/fuse and mounts) whose FUSE server runs as its volume's server uid
(`servers`) with no capabilities (`fsclient.keeper.privileges`). The plugin
never starts or signals a keeper itself: the keeper host does
(`keepers`), a process in a container of its own, so no mount depends on
the plugin's container. The plugin may not even see the keepers' pids (its
own pid namespace): every pid stays in the host. A plugin that starts keeps
every mount the host holds; a live mount whose keeper is not the host's (an
older plugin's, or one its server started when its keeper died) is
surrendered to a keeper the host starts; a target left without one gets a
new one (fsclient recovers the dead mount point first). One lock per target
serializes the calls on it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from fsclient import mount as fsmount
from fsclient import mountpoint as mp
from fsclient.keeper import Credentials, set_kernel_readahead, unmount_lazy

from .environment import ServerEnvironment, SourceCredentials
from .errors import CsiError
from .keepers import (
    Backoff,
    HostError,
    HostUnavailable,
    KeeperHost,
    NoKeeper,
    Refused,
    Squatted,
    Unanswered,
    take_over,
)
from .servers import ServerUsers
from .state import StateDir
from .volstats import StatfsWithDeadline, Usage
from .volumes import Publication, mount_command

log = logging.getLogger(__name__)

ADOPT_WORKERS = 4
# How long a restarted plugin asks again of a keeper its silent mount cannot
# vouch for (`Unanswered`) before it leaves that mount as it is: a loaded
# host answers within it; a hung mount must not keep the plugin unready.
UNANSWERED_PATIENCE = 60.0


def _unavailable(exc: Exception) -> CsiError:
    return CsiError(grpc.StatusCode.UNAVAILABLE, str(exc))


class Mounts:
    """The targets this node's plugin has published."""

    def __init__(self, state: StateDir, servers: ServerUsers, socket: str | None,
                 keepers: KeeperHost, environment: ServerEnvironment | None = None):
        self.state = state
        self.servers = servers
        self.socket = socket
        self.keepers = keepers
        self.environment = environment or ServerEnvironment()  # what keepers run with
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._statfs = StatfsWithDeadline()

    def _lock(self, target: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(target, threading.Lock())

    def _server(self, pub: Publication) -> Credentials:
        return self.servers.credentials(pub, self.socket)

    def _command(self, pub: Publication,
                 credentials: SourceCredentials) -> tuple[list[str], dict[str, str]]:
        """The keeper's `fsclient mount` arguments and its whole environment."""
        argv, _, env = mount_command(pub, self.state.key_file(pub.target), self.socket,
                                     self._server(pub), credentials, self.environment)
        return argv, env

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
                if self._keep(pub, patient=False):
                    self._check_mounted(pub)
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
        """Record `pub`, then have the host start its keeper; returns once the
        mount answers."""
        if mp.find_mount(pub.target) is None:  # a dead mount stays: fsclient recovers it
            os.makedirs(pub.target, 0o755, exist_ok=True)
        self.state.save_credentials(pub.target, credentials)
        self.state.save(pub, key)
        try:
            argv, env = self._command(pub, credentials)
            pid = self.keepers.spawn(argv, env, pub.target, pub.get("source") or "")
        except (HostError, HostUnavailable) as exc:
            if remove_on_failure:
                self.state.remove(pub.target)
            if isinstance(exc, HostUnavailable):
                raise _unavailable(exc) from None
            raise CsiError(grpc.StatusCode.INTERNAL,
                           f"mounting volume {pub.volume_id} ({pub.get('source')}) on "
                           f"{pub.target} failed: {exc}") from None
        self._check_mounted(pub)
        # the server, not root, may not set the mount's readahead window
        set_kernel_readahead(os.stat(pub.target).st_dev, fsmount.KERNEL_READAHEAD_KB)
        log.info("published volume %s on %s (keeper %d of the host)", pub.volume_id,
                 pub.target, pid)

    @staticmethod
    def _check_mounted(pub: Publication) -> None:
        """A publish answers OK only with this volume's mount on the target
        (the mount table, not a keeper's word)."""
        entry = mp.find_mount(pub.target)
        want = (mp.FSTYPE, f"blockcache:{pub.get('volume')}")
        if entry is None or (entry.fstype, entry.source) != want:
            found = "nothing" if entry is None else f"{entry.source} ({entry.fstype})"
            raise CsiError(grpc.StatusCode.INTERNAL,
                           f"{pub.target} holds {found}, not volume {pub.get('volume')}'s "
                           f"mount, after its keeper said it was ready; see the keeper "
                           f"host's log")

    def _host_keeper(self, target: str) -> int | None:
        try:
            return self.keepers.keeper_of(target)
        except (HostError, HostUnavailable) as exc:
            raise _unavailable(exc) from None

    def _keep(self, pub: Publication, patient: bool) -> bool:
        """Whether `pub`'s mount is kept: by a keeper of the host, or by a live
        keeper of another (then surrendered to one of the host's). `patient`:
        a keeper that will not surrender now is asked again until it does,
        and one its silent mount cannot vouch for (`Unanswered`) for
        UNANSWERED_PATIENCE, then left as it is."""
        backoff = Backoff()
        silent_since = None
        while True:
            if self._host_keeper(pub.target) is not None:
                return True  # (or is again: the host takes back a mount whose keeper it lost)
            try:
                self._take_over(pub)
                return True
            except NoKeeper:
                return False
            except Squatted as exc:  # nothing to take over, and no keeper of ours can bind
                if not patient:
                    raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"{pub.target} cannot be served: {exc}") from None
                log.error("%s cannot be taken over: %s", pub.target, exc)
                return False
            except Unanswered as exc:
                if not patient:
                    raise CsiError(grpc.StatusCode.UNAVAILABLE,
                                   f"the keeper of {pub.target} cannot be vouched for now "
                                   f"({exc}); try again") from None
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since >= UNANSWERED_PATIENCE:
                    log.error("%s stays with its keeper, as it is: its mount has not "
                              "answered for %g s (%s); see that mount's server",
                              pub.target, UNANSWERED_PATIENCE, exc)
                    return True
                backoff.wait(f"the mount {pub.target} does not name its keeper", exc)
            except Refused as exc:
                if not patient:
                    raise CsiError(grpc.StatusCode.UNAVAILABLE,
                                   f"the keeper of {pub.target} is busy ({exc}); "
                                   f"try again") from None
                backoff.wait(f"the keeper of {pub.target} does not surrender it", exc)
            except (HostError, HostUnavailable) as exc:
                # (the new keeper never acked: the old one serves on)
                log.error("%s stays with its keeper: the keeper host could not take it "
                          "over: %s", pub.target, exc)
                return True

    def _take_over(self, pub: Publication) -> None:
        argv, env = self._command(pub, self.state.credentials(pub.target))
        pid = take_over(pub.target, lambda named: self.keepers.spawn(
            argv, env, pub.target, pub.get("source") or "", named), via=self.keepers)
        log.info("took %s over: volume %s, keeper %d of the host", pub.target,
                 pub.volume_id, pid)

    # unpublish

    def unpublish(self, volume_id: str, target: str) -> None:
        with self._lock(target):
            known = self.state.load(target)
            if known is not None and known.volume_id != volume_id:
                raise CsiError(grpc.StatusCode.NOT_FOUND,
                               f"{target} holds volume {known.volume_id}, not {volume_id}; "
                               f"unpublish it with its own volume_id")
            try:
                keeper = self.keepers.keeper_of(target)
            except (HostError, HostUnavailable) as exc:
                keeper = None  # it ends with its mount all the same
                log.warning("unpublishing %s without the keeper host: %s", target, exc)
            for _ in range(8):  # mounts stacked on the target, ours on top
                if mp.find_mount(target) is None:
                    break
                try:
                    unmount_lazy(target)
                except OSError as exc:
                    raise CsiError(grpc.StatusCode.INTERNAL,
                                   f"cannot unmount {target}: {exc}") from None
            if keeper is not None:
                try:
                    self.keepers.stop(keeper)
                except (HostError, HostUnavailable) as exc:
                    log.warning("the keeper of %s was not stopped: %s", target, exc)
            self.state.remove(target)
            self._remove_target(target)
            log.info("unpublished volume %s from %s", volume_id, target)

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
        """Keep every recorded mount: the host's keepers stay as they are; a live
        keeper of another is surrendered to one of the host's (asked again
        while it refuses); a mount without one gets a new one. Returns when
        every record is handled (then the plugin may say it is ready)."""
        backoff = Backoff()
        while True:
            try:
                kept = {k["mountpoint"] for k in self.keepers.list() if k["ready"]}
                break
            except (HostError, HostUnavailable) as exc:
                backoff.wait("the keeper host does not answer", exc)
        log.info("the keeper host holds %d mounts", len(kept))
        with ThreadPoolExecutor(ADOPT_WORKERS, thread_name_prefix="adopt") as pool:
            list(pool.map(lambda pub: self._adopt(pub, kept), self.state.records()))

    def _adopt(self, pub: Publication, kept: set[str]) -> None:
        with self._lock(pub.target):
            try:
                if pub.target in kept or self._keep(pub, patient=True):
                    return
            except CsiError as exc:
                log.error("%s", exc.message)
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
