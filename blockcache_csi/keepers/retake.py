"""A keeper of ours killed alone (by a signal, not by our stop) leaves its
mount with its server, which starts the next keeper itself (fsclient's
successor): a keeper of the server's uid, outside our table. The host takes
that mount back to a keeper of its own at once, as a plugin's start would,
so that `list` shows every live mount and a host upgrade moves it with the
rest.

Asked from here, in the keepers' pid namespace, the successor is trusted as
the keeper the mount names (`fsclient.keeper.control.check`). It binds the
mount's control name a moment after the kill (NoKeeper until then), and the
mount names it only once the server has handed over (until then it is not
trusted: Squatted, and asked nothing); both are tried again for up to
LOST_WAIT. A keeper that refuses (busy) is asked again, never given up.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from fsclient import mountpoint as mp

from .children import Child, SpawnError
from .takeover import Backoff, NoKeeper, Refused, Squatted, take_over

if TYPE_CHECKING:
    from .host import Host

log = logging.getLogger(__name__)

LOST_WAIT = 60.0  # a successor's time to bind the control name; then the mount is dead


def retake(host: Host, lost: Child) -> None:
    """Take `lost`'s mount back to a keeper of `host` (its own thread)."""
    mountpoint = lost.mountpoint
    deadline = time.monotonic() + LOST_WAIT
    backoff = Backoff()
    while not host.stop.is_set() and not host.replaced():
        if host.children.has(mountpoint) or mp.find_mount(mountpoint) is None:
            return  # ours again (a plugin's start asked first), or unmounted
        try:
            pid = take_over(mountpoint, lambda named: host.start_keeper(
                mountpoint, lost.source, lost.argv, lost.env, named))
        except (NoKeeper, Squatted) as exc:
            if time.monotonic() > deadline:
                log.warning("%s lost its keeper %d and no keeper we trust answers for it "
                            "after %gs (%s): left to the plugin's next start", mountpoint,
                            lost.pid, LOST_WAIT, exc)
                return
            why: Exception = exc
        except (Refused, SpawnError) as exc:
            why = exc
        else:
            log.info("took %s back from the keeper its server started when keeper %d "
                     "ended: keeper %d", mountpoint, lost.pid, pid)
            return
        backoff.wait(f"{mountpoint} lost its keeper {lost.pid}; taking it back", why)
