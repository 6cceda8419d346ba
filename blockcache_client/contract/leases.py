"""Fetch leases: what daemon and readers agree on so that a cold block is
fetched once per host, whoever asks (`lease`, `wait` and `release` ops).

    lease    keys:[str]  -> states:[str]   one state per key (below); `keys`
                                           is a run of one file's blocks, at
                                           most MAX_LEASE_KEYS, the block the
                                           reader wants first; keys are
                                           granted in order up to the first
                                           one that is not
    wait     key:str     -> outcome:str    answered when the outcome is known
                                           (below), at the latest when the
                                           lease's `lease_timeout` ends; the
                                           connection answers nothing else
                                           meanwhile
    release  keys:[str]  -> released:int   the leases of this connection on
                                           those keys end (RELEASED)

`hello` names `lease_timeout` (seconds): how long a lease lasts at most from
its grant. Absent or 0: the daemon grants none (every state is NONE).

A lease belongs to the connection it was granted on and ends with it.
Every other way it ends is an outcome its waiters are told.
"""

from __future__ import annotations

# lease states
GRANTED = "granted"  # yours (or yours already): fetch the block and hand it to the daemon
HELD = "held"        # another connection is fetching it: `wait` for it, or fetch it yourself
CACHED = "cached"    # in the cache already: read it there
NONE = "none"        # no lease for you (leases off, your uid holds its share, or an
                     # earlier key of the run was not granted): fetch it without one
STATES = (GRANTED, HELD, CACHED, NONE)

# wait outcomes: only FILLED means the block is there to read
FILLED = "filled"      # the block is in the cache
EXPIRED = "expired"    # its holder did not fill it within lease_timeout
LOST = "lost"          # its holder's connection closed first
DECLINED = "declined"  # the daemon did not cache the block put for it (full, not
                       # admitted, over quota, ...) or its write failed
RELEASED = "released"  # its holder gave it up (its fetch failed, or its fill was dropped)
FREE = "free"          # nobody holds it (the lease ended before the wait began)
OUTCOMES = (FILLED, EXPIRED, LOST, DECLINED, RELEASED, FREE)

# most keys in one lease or release: a window's part (8 MiB) of 4 KiB
# blocks; a reader leases a longer run's first MAX_LEASE_KEYS only
MAX_LEASE_KEYS = 2048
