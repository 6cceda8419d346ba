"""Taking a live mount from the keeper that serves it: the keeper surrenders
its connection (`fsclient.keeper.surrender`) and a new keeper is started with
it (`start`, given the (name, fd) pairs to pass on). Until the new keeper acks,
the old one serves on; if the new one never acks, nothing changed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from fsclient import keeper as fskeeper

log = logging.getLogger(__name__)

T = TypeVar("T")
SURRENDER_TIMEOUT = 30.0  # a live keeper's time to answer `surrender`
RETRY_FIRST, RETRY_MAX = 0.5, 5.0
RETRY_LOG_EVERY = 30.0


class NoKeeper(Exception):
    """Nothing listens on the mount point's control socket."""


class Refused(Exception):
    """The keeper would not surrender now (busy: a restart running, say)."""


class Squatted(Exception):
    """The mount point's control name is held by a process that is not a
    keeper this plugin trusts (another uid: `fsclient.keeper.Impostor`);
    nothing was asked of it, and asking again would not help."""


def take_over(mountpoint: str, start: Callable[[list[tuple[str, int]]], T]) -> T:
    """`start` a new keeper with the connection of `mountpoint`'s keeper."""
    try:
        surrendered = fskeeper.surrender(mountpoint, SURRENDER_TIMEOUT)
    except fskeeper.Impostor as exc:
        raise Squatted(str(exc)) from None
    except ValueError as exc:
        raise Refused(str(exc)) from None
    except (ConnectionRefusedError, FileNotFoundError) as exc:
        raise NoKeeper(str(exc)) from None
    except OSError as exc:  # alive but slow (a handover in progress): not gone
        raise Refused(f"it did not answer: {exc}") from None
    try:
        return start(surrendered.named())
    finally:
        surrendered.close()  # the new keeper has its own copies, or none is needed


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
