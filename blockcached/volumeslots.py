"""Volume slots: which volumes the daemon holds state for, which uid brought
each in, and the per-volume counters.

`max_volumes` slots bound the per-volume state (index counters, stats,
metric labels) whatever names clients choose. A volume holds a slot while it
has blocks cached or puts queued; the cache releases it when the last of
them goes, so a volume with no blocks left is forgotten. Each slot is
owned by the uid whose put brought its volume in, and a uid may own at most
`per_uid` of them (`max_volumes_per_uid`), so one uid making up volume
names fills its own share, not every slot. An admin's volumes, and those a
rebuild finds on disk (ownership is not stored there), are owned by nobody:
they count to `max_volumes` but to no uid.

A released volume's counters stay (a "ghost"), so a volume whose blocks
come and go keeps its reader hits and misses, until a new volume needs
their room: counters never number more than `max_volumes`.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class VolumeSlots:
    """The slots of `limit` volumes, at most `per_uid` of them (0 = no such
    limit) owned by any one uid."""

    def __init__(self, limit: int, per_uid: int = 0):
        self.limit = limit
        self.per_uid = per_uid
        self.owners: dict[str, int | None] = {}  # volume -> owning uid (None: nobody's)
        self.owned: dict[int, int] = {}  # uid -> slots it owns (uids owning some only)
        # per volume: [touches, touch_bytes, puts, put_bytes], of volumes with
        # a slot and of released ones while there is room (`_ghosts`, oldest first)
        self.counters: dict[str, list[int]] = {}
        self._ghosts: dict[str, None] = {}
        self._over_limit_logged = False

    def __contains__(self, volume: str) -> bool:
        return volume in self.owners

    def __len__(self) -> int:
        return len(self.owners)

    def claim(self, volume: str, uid: int | None) -> str | None:
        """Give `volume` a slot owned by `uid` (None: an admin's, owned by
        nobody) unless it has one; None if it has one now, else why not:
        "volume_share" (`uid` owns `per_uid` slots) or "too_many_volumes"."""
        if volume in self.owners:
            return None
        if uid is not None and self.per_uid and self.owned.get(uid, 0) >= self.per_uid:
            return "volume_share"
        if len(self.owners) >= self.limit:
            return "too_many_volumes"
        self.owners[volume] = uid
        if uid is not None:
            self.owned[uid] = self.owned.get(uid, 0) + 1
        self._ghosts.pop(volume, None)
        return None

    def adopt(self, volume: str) -> None:
        """A volume found on disk by a rebuild holds a slot owned by nobody,
        even past `limit` (its blocks are there; new volumes wait until
        enough have left)."""
        if volume in self.owners:
            return
        self.owners[volume] = None
        self._ghosts.pop(volume, None)
        if len(self.owners) > self.limit and not self._over_limit_logged:
            self._over_limit_logged = True
            log.warning("the cache holds blocks of more than max_volumes (%d) volumes; blocks "
                        "of new volumes are refused (too_many_volumes) until some are evicted: "
                        "raise max_volumes to cache them all", self.limit)

    def release(self, volume: str) -> None:
        """Forget `volume` (no blocks cached, no puts queued): its slot is free."""
        if volume not in self.owners:
            return
        uid = self.owners.pop(volume)
        if uid is not None:
            left = self.owned[uid] - 1
            if left:
                self.owned[uid] = left
            else:
                del self.owned[uid]
        if volume in self.counters:
            self._ghosts[volume] = None

    def owned_by(self, uid: int) -> int:
        return self.owned.get(uid, 0)

    def counter(self, volume: str) -> list[int] | None:
        """The counters of `volume`: made for a volume holding a slot (the
        oldest ghost's give way when `limit` are kept), None for one without."""
        c = self.counters.get(volume)
        if c is None and volume in self.owners:
            if len(self.counters) >= self.limit and self._ghosts:
                gone = next(iter(self._ghosts))
                del self._ghosts[gone]
                del self.counters[gone]
            if len(self.counters) < self.limit:
                c = self.counters[volume] = [0, 0, 0, 0]
        return c

    def stats(self) -> dict[str, int]:
        return {"held": len(self.owners), "limit": self.limit, "per_uid": self.per_uid,
                "owners": len(self.owned),
                "unowned": len(self.owners) - sum(self.owned.values())}
