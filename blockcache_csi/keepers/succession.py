"""A keeper host replacing another (an upgrade: the new pod starts beside the
old one): every keeper of the old host moves to one of ours before we are
ready, so the old pod may then go with everything in it.

1. Ask the old host (at the socket path, still its) for its keepers; take
   each over (`takeover`: it surrenders to a keeper we start with the same
   argv and env). A keeper still starting, or refusing (busy), is tried
   again with a backoff, never given up.
2. Keep a link to the old host's socket, rename ours over the path: from now
   on publishes come to us, and the old host refuses new spawns (it sees
   its socket replaced and says so; the plugin asks again, reaching us).
3. Ask the old host again, and take over what it started meanwhile (a
   publish that raced step 2), until it has nothing we have not taken.

Only then is the ready file written. With no old host, 2 alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from typing import TYPE_CHECKING, Any

from .children import SpawnError
from .client import HostError, HostUnavailable, KeeperHost
from .takeover import Backoff, NoKeeper, Refused, Squatted, take_over

if TYPE_CHECKING:
    from .host import Host

log = logging.getLogger(__name__)


def _old_host(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def succeed(host: Host, bound: str) -> None:
    """Take over the old host's keepers (if one serves at `host.path`), then
    publish our socket."""
    old = KeeperHost(host.path)
    taken: set[int] = set()
    if _old_host(host.path):
        try:
            old.list()
        except (HostUnavailable, HostError) as exc:
            log.info("no keeper host answers at %s (%s): starting afresh", host.path, exc)
        else:
            _take_all(host, old, taken)
            link = f"{bound}.old"
            os.link(host.path, link)
            try:
                host.publish(bound)
                _take_all(host, KeeperHost(link), taken)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(link)
            log.info("took over %d keepers from the keeper host before", len(taken))
            return
    host.publish(bound)


def _take_all(host: Host, old: KeeperHost, taken: set[int]) -> None:
    """Take over every keeper `old` lists, until none is left that we have not."""
    backoff = Backoff()
    while not host.stop.is_set():
        try:
            keepers = old.list()
        except (HostUnavailable, HostError) as exc:
            log.info("the keeper host before has gone (%s)", exc)
            return
        todo = [k for k in keepers if not (k["pid"] and k["pid"] in taken)]
        if not todo:
            return
        waiting = []
        for k in todo:
            why = _take(host, k) if k["ready"] else "it is still starting"
            if why is None:
                taken.add(k["pid"])
            else:
                waiting.append(f"{k['mountpoint']}: {why}")
        if waiting:
            backoff.wait(f"{len(waiting)} keepers of the host before are not ours yet",
                         "; ".join(waiting[:3]))


def _take(host: Host, k: dict[str, Any]) -> str | None:
    """Take keeper `k` over; None once done, else why not (yet)."""
    mountpoint = k["mountpoint"]
    if host.children.serving(mountpoint) is not None:
        return None  # ours already (its old keeper is leaving)

    try:
        pid = take_over(mountpoint, lambda named: host.start_keeper(
            mountpoint, k["source"], k["argv"], k["env"], named))
    except Squatted as exc:  # not its keeper: asking again would not help
        log.error("%s cannot be taken over from the host before: %s", mountpoint, exc)
        return None
    except (Refused, NoKeeper, SpawnError) as exc:
        return str(exc)
    log.info("took %s over from keeper %d of the host before: keeper %d", mountpoint,
             k["pid"], pid)
    return None
