"""Fetch leases: which connection is fetching each cold block, and who waits for it.

The first reader on the host to miss a block takes a lease on its key
(`take`); a reader of another connection that misses it meanwhile is told
HELD and may `wait`: its reply is held back until the lease ends, and the
way it ended is the answer (`contract.leases`). A lease ends, and each
of its waiters is answered, exactly once, at the first of:

- the block lands in the index (`written`, or a put answered `exists`): FILLED;
- a put of it is not queued (full, not admitted, ...) or its write fails: DECLINED;
- its holder releases it: RELEASED;
- its holder's connection closes (`gone`): LOST, unless a put of the
  block is queued already (then the block's landing or failure ends it);
- `timeout` seconds after its grant: EXPIRED.

So no wait outlives its lease, and no lease lives past `timeout`, whatever
its holder does. A waiter's connection that closes leaves the waiters
(`gone`). The table is bounded like the daemon's other per-peer state:
at most MAX_LEASES leases, non-admin uids together all but ADMIN_RESERVED
of them, and each non-admin uid at most `per_uid`; past a bound a key gets
NONE (fetch it without a lease) and the refusal is counted. Waits need no
bound of their own: a connection waits for one key at a time (the server
reads nothing more from it meanwhile), so there are at most as many waits
as connections.

Nothing here is stored: a restarted daemon has no leases, and every
reader's connection to the old one closed, so each waiter fetches itself.
Everything runs on the event loop (`take` starts its expiry timer there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from blockcache_client.contract.errors import ProtocolError
from blockcache_client.contract.leases import (
    CACHED,
    DECLINED,
    EXPIRED,
    FILLED,
    FREE,
    GRANTED,
    HELD,
    LOST,
    NONE,
    RELEASED,
)
from blockcache_client.contract.protocol import ErrorCode

MAX_LEASES = 16384
ADMIN_RESERVED = 2048  # of MAX_LEASES, for admin peers only
# put reasons after which the block will be in the index soon, or is now
_WILL_LAND = frozenset({"queued", "duplicate"})

Answer = Callable[[str], None]  # tells one waiter its outcome


class _Lease:
    __slots__ = ("holder", "uid", "waiters", "batch")

    def __init__(self, holder: object, uid: int | None, batch: _Batch):
        self.holder = holder  # None once its connection closed with its block landing
        self.uid = uid  # None: an admin's (counted to no uid)
        self.waiters: list[tuple[object, Answer]] = []
        self.batch = batch


class _Batch:
    """The leases one `lease` request granted: one deadline, one timer."""

    __slots__ = ("keys", "live", "timer")

    def __init__(self) -> None:
        self.keys: list[str] = []  # those granted (not the whole request: it may be long)
        self.live = 0
        self.timer: asyncio.TimerHandle | None = None


class LeaseTable:
    """The host's fetch leases (see the module). `timeout` 0: none granted."""

    def __init__(self, timeout: float, per_uid: int):
        self.timeout = timeout
        self.per_uid = per_uid
        self._leases: dict[str, _Lease] = {}
        self._by_holder: dict[object, set[str]] = {}
        self._by_uid: dict[int, int] = {}  # leases held per non-admin uid
        self._of_uids = 0  # leases held by non-admin uids, in all
        self._waiting: dict[object, str] = {}  # waiter -> the key it waits for
        self.landing: Callable[[str], bool] = _never  # a put of the key is queued
        self.counts = dict(taken=0, waits=0, saved=0, filled=0, expired=0, lost=0,
                           declined=0, released=0, refused=0)

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    def __contains__(self, key: str) -> bool:
        return key in self._leases

    def awaited(self, key: str) -> bool:
        """Someone waits for `key`'s fill now."""
        lease = self._leases.get(key)
        return lease is not None and bool(lease.waiters)

    def take(self, keys: list[str], holder: object, uid: int, admin: bool,
             cached: Callable[[str], bool]) -> list[str]:
        """The state of each key of a run for `holder` (a connection of peer
        `uid`). Free keys are granted in order while its uid has room, up to
        the first key not granted: the keys after it are not granted either
        (NONE if free), so what a reader fetches stays one contiguous run."""
        states = []
        batch = None
        granting = self.enabled
        owner = None if admin else uid
        for key in keys:
            lease = self._leases.get(key)
            if lease is not None:
                mine = lease.holder is holder
                states.append(GRANTED if mine else HELD)
                granting = granting and mine
            elif cached(key):
                states.append(CACHED)
                granting = False
            elif granting and self._room(owner):
                if batch is None:
                    batch = _Batch()
                self._grant(key, holder, owner, batch)
                states.append(GRANTED)
            else:
                self.counts["refused"] += granting
                states.append(NONE)
                granting = False
        if batch is not None:
            loop = asyncio.get_running_loop()
            batch.timer = loop.call_later(self.timeout, self._expire, batch)
        return states

    def _room(self, owner: int | None) -> bool:
        held = len(self._leases)
        if held >= MAX_LEASES:
            return False
        if owner is None:
            return True
        return (self._of_uids < MAX_LEASES - ADMIN_RESERVED
                and (not self.per_uid or self._by_uid.get(owner, 0) < self.per_uid))

    def _grant(self, key: str, holder: object, owner: int | None, batch: _Batch) -> None:
        self._leases[key] = _Lease(holder, owner, batch)
        self._by_holder.setdefault(holder, set()).add(key)
        if owner is not None:
            self._by_uid[owner] = self._by_uid.get(owner, 0) + 1
            self._of_uids += 1
        batch.keys.append(key)
        batch.live += 1
        self.counts["taken"] += 1

    def wait(self, key: str, waiter: object, answer: Answer,
             cached: Callable[[str], bool]) -> str | None:
        """`key`'s outcome now (FILLED: cached; FREE: no lease on it), or
        None: `answer` is called with it when the lease ends."""
        if waiter in self._waiting:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "this connection waits for a block "
                                                       "already: one wait at a time")
        lease = self._leases.get(key)
        if lease is None:
            self.counts["waits"] += 1
            filled = cached(key)
            self.counts["saved"] += filled
            return FILLED if filled else FREE
        if lease.holder is waiter:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"this connection holds the lease on {key}: it has nothing "
                                f"to wait for (fetch the block, or release the lease)")
        lease.waiters.append((waiter, answer))
        self._waiting[waiter] = key
        self.counts["waits"] += 1
        return None

    def release(self, keys: list[str], holder: object) -> int:
        """End `holder`'s leases on `keys` (others' are left alone)."""
        n = 0
        for key in keys:
            lease = self._leases.get(key)
            if lease is not None and lease.holder is holder:
                self._end(key, RELEASED, "released")
                n += 1
        return n

    def written(self, key: str, indexed: bool) -> None:
        """A write of `key` ended: in the index now, or not (failed, cancelled)."""
        if key not in self._leases:
            return
        if indexed:
            self._end(key, FILLED, "filled")
        else:
            self._end(key, DECLINED, "declined")

    def put_answered(self, key: str, reason: str) -> None:
        """A put of `key` was answered `reason` (cache.put's)."""
        if key not in self._leases or reason in _WILL_LAND:
            return
        if reason == "exists":
            self._end(key, FILLED, "filled")
        else:
            self._end(key, DECLINED, "declined")

    def gone(self, conn: object) -> None:
        """`conn` closed: its wait is over, and its leases are lost to their
        waiters, but for those whose block is queued for writing already
        (`landing`): they end when it lands (or at their deadline), as a
        holder that closes once its fills are answered expects."""
        key = self._waiting.pop(conn, None)
        if key is not None:
            lease = self._leases.get(key)
            if lease is not None:
                lease.waiters = [w for w in lease.waiters if w[0] is not conn]
        for key in self._by_holder.pop(conn, ()):
            lease = self._leases[key]
            lease.holder = None  # nobody's now
            if not self.landing(key):
                self._end(key, LOST, "lost")

    def _expire(self, batch: _Batch) -> None:
        batch.timer = None
        for key in batch.keys:
            lease = self._leases.get(key)
            if lease is not None and lease.batch is batch:
                self._end(key, EXPIRED, "expired")

    def _end(self, key: str, outcome: str, counter: str) -> None:
        lease = self._leases.pop(key)
        mine = self._by_holder.get(lease.holder) if lease.holder is not None else None
        if mine is not None:
            mine.discard(key)
            if not mine:
                del self._by_holder[lease.holder]
        if lease.uid is not None:
            self._of_uids -= 1
            left = self._by_uid[lease.uid] - 1
            if left:
                self._by_uid[lease.uid] = left
            else:
                del self._by_uid[lease.uid]
        batch = lease.batch
        batch.live -= 1
        if not batch.live and batch.timer is not None:
            batch.timer.cancel()
            batch.timer = None
        self.counts[counter] += 1
        if outcome == FILLED:
            self.counts["saved"] += len(lease.waiters)
        for waiter, answer in lease.waiters:
            self._waiting.pop(waiter, None)
            answer(outcome)

    def stats(self) -> dict[str, int]:
        return {"held": len(self._leases), "waiting": len(self._waiting),
                "timeout": self.timeout, "limit": MAX_LEASES, "per_uid": self.per_uid,
                "holders": len(self._by_holder), **self.counts}


def _never(_: str) -> bool:
    return False
