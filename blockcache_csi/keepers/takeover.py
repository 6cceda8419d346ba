"""Taking a live mount from the keeper that serves it: the keeper surrenders
its connection (`fsclient.keeper.surrender`) and a new keeper is started with
it (`start`, given the (name, fd) pairs to pass on). Until the new keeper acks,
the old one serves on; if the new one never acks, nothing changed.

The plugin asks for the connection through the keeper host (`via`), which
asks the keeper itself: a keeper that a server started when its own keeper
died runs as the server's uid, and is trusted only by its pid
(`fsclient.keeper.control.check`), which a plugin in a pid namespace of its
own cannot see (SO_PEERCRED names it 0). The host, whose namespace the
keepers are in, can.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

from fsclient import keeper as fskeeper

from .client import HostError, KeeperHost

log = logging.getLogger(__name__)

T = TypeVar("T")
SURRENDER_TIMEOUT = 30.0  # a live keeper's time to answer `surrender`
RETRY_FIRST, RETRY_MAX = 0.5, 5.0
RETRY_LOG_EVERY = 30.0


class NoKeeper(Exception):
    """Nothing listens on the mount point's control socket."""


class Refused(Exception):
    """The keeper would not surrender now (busy: a restart running, say)."""


class Unanswered(Refused):
    """The keeper could not be vouched for now: it is of another uid, and the
    mount that would name it did not answer (`fsclient.keeper.Unvouched`).
    Asked again for a while (a loaded host); a mount silent for long is hung
    (`mounts.UNANSWERED_PATIENCE`)."""


class Squatted(Exception):
    """The mount point's control name is held by a process that is not a
    keeper this plugin trusts (another uid: `fsclient.keeper.Impostor`);
    nothing was asked of it. Asking again helps only while a server's
    successor is taking the mount over, before the mount names it (`retake`)."""


# (a subclass before its base: `refusal` names the first that matches)
REFUSALS: dict[str, type[Exception]] = {"none": NoKeeper, "unanswered": Unanswered,
                                        "busy": Refused, "squatted": Squatted}


def surrender_here(mountpoint: str) -> fskeeper.Surrendered:
    """The connection of `mountpoint`'s keeper, asked by this process: NoKeeper,
    Refused (Unanswered) or Squatted if it cannot have it."""
    try:
        return fskeeper.surrender(mountpoint, SURRENDER_TIMEOUT)
    except fskeeper.Unvouched as exc:  # (the mount was slow to name its keeper)
        raise Unanswered(str(exc)) from None
    except fskeeper.Impostor as exc:
        raise Squatted(str(exc)) from None
    except ValueError as exc:
        raise Refused(str(exc)) from None
    except (ConnectionRefusedError, FileNotFoundError) as exc:
        raise NoKeeper(str(exc)) from None
    except OSError as exc:  # alive but slow (a handover in progress): not gone
        raise Refused(f"it did not answer: {exc}") from None


def refusal(exc: Exception) -> str:
    """The name of a refusal (`REFUSALS`), as the keeper host's wire carries it."""
    return next(name for name, kind in REFUSALS.items() if isinstance(exc, kind))


def take_over(mountpoint: str, start: Callable[[list[tuple[str, int]]], T],
              via: KeeperHost | None = None) -> T:
    """`start` a new keeper with the connection of `mountpoint`'s keeper,
    surrendered to this process or, `via` a keeper host, to that host."""
    if via is None:
        surrendered = surrender_here(mountpoint)
        try:
            return start(surrendered.named())
        finally:
            surrendered.close()  # the new keeper has its own copies, or none is needed
    try:
        named = via.surrender(mountpoint)
    except HostError as exc:
        if exc.refusal in REFUSALS:
            raise REFUSALS[exc.refusal](str(exc)) from None
        raise
    try:
        return start(named)
    finally:
        for _, fd in named:
            os.close(fd)


class Backoff:
    """Waits between tries of something that must not be given up: doubling
    up to RETRY_MAX, logging at most every RETRY_LOG_EVERY seconds."""

    def __init__(self) -> None:
        self.delay = RETRY_FIRST
        self.tries = 0
        self._logged = 0.0

    def wait(self, what: str, why: object) -> None:
        self.tries += 1
        now = time.monotonic()
        if now - self._logged >= RETRY_LOG_EVERY:
            self._logged = now
            log.warning("%s: %s; trying again (try %d)", what, why, self.tries)
        time.sleep(self.delay)
        self.delay = min(RETRY_MAX, self.delay * 2)
