"""A reader's side of the daemon's fetch leases (`contract.leases`).

One `Leases` per volume link and process:

- `take` asks for leases on a run of blocks on the process's lease
  connection, used only for `lease` and `release` (round trips of tens of
  microseconds, one thread at a time). Every lease of the process lives on
  it, so they all end when the process dies or the connection drops: their
  waiters are told LOST and fetch the blocks themselves.
- `wait` waits for another reader's fill on a connection of its own, from
  a pool of at most `WAITERS` (a wait holds its connection until the lease
  ends, up to the daemon's `lease_timeout`); a reader finding none free
  does not wait.

Fails open, never raises into a reader: no daemon, an older daemon
(`hello` names no `lease_timeout`), an error reply or a timeout each make
`take` answer None (no leases: fetch as if alone) and `wait` answer ""
(fetch it yourself). A daemon that failed a call is not asked again for
`BACKOFF` seconds, so a hung daemon costs one timeout, not one per miss.

A holder that never fills costs a waiter `lease_timeout` once: after a
wait that ends EXPIRED the process waits for no lease for
`NO_WAIT_AFTER_EXPIRY` seconds (it still takes leases, so others can wait
for it), so no holder, however many blocks it leases again and again,
delays this reader by more than `lease_timeout` in that time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from ..common.counters import Counters
from ..contract.errors import DaemonError, DaemonUnavailable
from ..contract.leases import EXPIRED, FILLED, GRANTED, OUTCOMES, STATES
from .client import Client

log = logging.getLogger(__name__)

TAKE_TIMEOUT = 1.0  # a lease is a lookup's cost: a daemon slower than this is too slow
WAIT_MARGIN = 1.0  # past lease_timeout, how late a wait's answer may be before giving up
WAITERS = 8  # connections waiting at once per volume and process
BACKOFF = 5.0  # seconds without leases after a call failed (a hung daemon: the link notices first)
NO_WAIT_AFTER_EXPIRY = 30.0


class Leases:
    """Fetch leases of one volume in one process (see the module)."""

    def __init__(self, socket_path: str, counters: Counters, daemon_up: Callable[[], bool],
                 daemon_uid: int | None = None):
        self.socket_path = socket_path
        self.timeout = 0.0  # the daemon's lease_timeout (its hello's); 0: no leases
        self._counters = counters
        self._daemon_up = daemon_up
        self._daemon_uid = daemon_uid
        self._holder = Client(socket_path, timeout=TAKE_TIMEOUT, daemon_uid=daemon_uid)
        self._idle: list[Client] = []  # wait connections not in use
        self._waiters = 0  # wait connections made and not closed
        self._lock = threading.Lock()
        self._off_until = 0.0  # no leases before this (time.monotonic): a call failed
        self._no_wait_until = 0.0  # no waits before this: a wait expired

    @property
    def usable(self) -> bool:
        return self.timeout > 0 and self._daemon_up() and time.monotonic() >= self._off_until

    def take(self, keys: Sequence[str]) -> list[str] | None:
        """One state per key (`contract.leases`), or None: no leases now."""
        if not self.usable:
            return None
        try:
            states = self._holder.lease(keys)
        except (DaemonError, DaemonUnavailable, KeyError) as exc:
            self._failed("lease", exc)
            return None
        if not isinstance(states, list) or len(states) != len(keys) or any(
                s not in STATES for s in states):
            self._failed("lease", ValueError(f"answered {states!r}"))
            return None
        granted = states.count(GRANTED)
        if granted:
            self._counters.add("leases_taken", granted)
        return states

    def wait(self, key: str) -> str:
        """How the lease on `key` ended (FILLED: the block is in the cache),
        or "" where this reader did not wait or the daemon did not answer."""
        if time.monotonic() < self._no_wait_until or not self.usable:
            return ""
        client = self._waiter()
        if client is None:
            return ""
        self._counters.add("lease_waits")
        outcome = ""
        try:
            outcome = client.wait(key)
        except (DaemonError, DaemonUnavailable, KeyError) as exc:
            self._failed("wait", exc)
        finally:
            self._give(client)
        if outcome not in OUTCOMES:
            outcome = ""
        if outcome == FILLED:
            self._counters.add("lease_saved")
        else:
            self._counters.add("lease_gave_up")
            if outcome == EXPIRED:
                log.info("a fetch lease on a block of %s expired: fetching without waiting "
                         "for others' fills for %gs", self.socket_path, NO_WAIT_AFTER_EXPIRY)
                self._no_wait_until = time.monotonic() + NO_WAIT_AFTER_EXPIRY
        return outcome

    def release(self, keys: Sequence[str]) -> None:
        """End this process's leases on `keys` (its fetch failed, or its fill
        was dropped), so their waiters fetch at once. Best effort."""
        if not keys or self.timeout <= 0:
            return
        try:
            self._holder.release(keys)
        except (DaemonError, DaemonUnavailable, KeyError) as exc:
            self._failed("release", exc)

    def close(self) -> None:
        self._holder.close()
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def _waiter(self) -> Client | None:
        """A connection to wait on: an idle one, a new one while fewer than
        WAITERS exist, else None."""
        with self._lock:
            if self._idle:
                client = self._idle.pop()
                client.timeout = self.timeout + WAIT_MARGIN  # (a new daemon's may differ)
                return client
            if self._waiters >= WAITERS:
                return None
            self._waiters += 1
        return Client(self.socket_path, timeout=self.timeout + WAIT_MARGIN,
                      daemon_uid=self._daemon_uid)

    def _give(self, client: Client) -> None:
        with self._lock:
            self._idle.append(client)

    def _failed(self, op: str, exc: Exception) -> None:
        log.debug("fetch lease %s at %s failed (%s): no leases for %gs", op, self.socket_path,
                  exc, BACKOFF)
        self._off_until = time.monotonic() + BACKOFF
