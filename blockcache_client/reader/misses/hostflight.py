"""Host-wide single flight: a block missing on the host is fetched once,
whichever process asks (the daemon's fetch leases, `daemonclient.leases`).

`singleflight` makes one thread of a process fetch a block; this makes one
reader of the host fetch it. Before a miss is fetched, the run one request
would bring (the block, then the following blocks this process claimed) is
leased from the daemon in one round trip. The daemon grants a run's leases
in order and stops at the first block it does not grant, so what a reader
fetches stays one contiguous request. For the wanted block:

- GRANTED: this reader fetches it, with the following blocks it was
  granted (a window's part is one request and one lease round trip);
- CACHED: another reader filled it since this one looked: read it there;
- HELD: another reader (another process or mount) is fetching it: wait for
  its fill, at most until its lease ends (the daemon's `lease_timeout`
  after it was granted). FILLED: read it from the cache. Anything else
  (its holder died, released or did not fill it, the daemon is gone or
  slow, no connection was free to wait on): fetch it here, with the
  following blocks nobody holds;
- NONE, or no answer (no daemon, leases off, the uid holds its share, the
  volume is not its to read): fetch the run as if alone.

A lease taken ends when its block lands in the cache (the daemon sees to
it), or when `Run.drop` / `Run.failed` release it: the block will not reach
the daemon (its fill was dropped) or the fetch failed. Releasing at once
lets its waiters fetch now instead of at the bound.
"""

from __future__ import annotations

from ...contract.leases import CACHED, FILLED, GRANTED, HELD, MAX_LEASE_KEYS, NONE
from ...daemonclient.leases import Leases


class Run:
    """What a reader fetches of a run of blocks it leased (see the module):
    `landed`, the wanted block is in the host cache now; else the first
    `count` blocks of the run, whose leases (`leased`) it holds."""

    __slots__ = ("landed", "count", "leased", "_leases")

    def __init__(self, leases: Leases | None, landed: bool, count: int,
                 leased: set[str] | None = None):
        self._leases = leases
        self.landed = landed
        self.count = count
        self.leased = leased or set()

    def drop(self, keys: list[str]) -> None:
        """These blocks will not reach the daemon from here: release them."""
        mine = [k for k in keys if k in self.leased]
        if mine and self._leases is not None:
            self.leased.difference_update(mine)
            self._leases.release(mine)

    def failed(self) -> None:
        """The fetch failed: every lease still held goes."""
        self.drop(list(self.leased))


class HostFlight:
    """Fetch leases of one volume in one process."""

    def __init__(self, leases: Leases):
        self._leases = leases

    def longest(self, run: int) -> int:
        """The most blocks one request may bring: a run leased at once."""
        return min(run, MAX_LEASE_KEYS) if self._leases.usable else run

    def begin(self, keys: list[str], leased: bool = True) -> Run:
        """What to do about `keys` (the wanted block first, then the ones
        one request would bring with it). `leased` False: fetch as if alone."""
        states = self._leases.take(keys) if leased else None
        if states is None:
            return Run(None, False, len(keys))
        first = states[0]
        if first == CACHED:
            return Run(None, True, 0)
        if first == HELD:
            if self._leases.wait(keys[0]) == FILLED:
                return Run(None, True, 0)
            first = NONE  # fetch it here, without a lease
        n = 1
        while n < len(keys) and states[n] in (GRANTED, NONE):
            n += 1
        mine = {k for k, s in zip(keys[:n], states) if s == GRANTED}
        return Run(self._leases, False, n, mine)
