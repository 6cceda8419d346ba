"""Who may open another connection to the daemon, and the open ones by peer uid.

- At most `MAX_CONNECTIONS` in all (each is a descriptor and some memory).
- Non-admin peers may hold all but `ADMIN_RESERVED` of them, so an admin
  (root, which runs the FUSE clients, by default) can always connect, however
  many uids fill the rest.
- Per peer uid, at most `max_connections_per_uid`: its default (768) lets four
  uids at it leave a fifth its whole share of the 3,840 non-admins may hold.

A refused connection is aborted at accept by the server, counted and logged.
"""

from __future__ import annotations

from typing import Generic, TypeVar

MAX_CONNECTIONS = 4096
ADMIN_RESERVED = 256  # of MAX_CONNECTIONS, for admin peers only

C = TypeVar("C")


class ConnectionLimits(Generic[C]):
    """The open connections (`C`, the server's) by peer uid, and the limits
    a new one must pass. `per_uid` 0 = no per-uid limit."""

    def __init__(self, per_uid: int):
        self.per_uid = per_uid
        self.by_uid: dict[int, set[C]] = {}
        self.open = 0
        self.admins = 0  # of `open`, admin peers' (ADMIN_RESERVED is theirs)

    def admit(self, conn: C, uid: int, admin: bool) -> str | None:
        """Count `conn` of peer `uid` as open; or, if a limit forbids it,
        why not (nothing counted)."""
        if self.open >= MAX_CONNECTIONS:
            return f"the daemon holds {self.open} connections, its most"
        if not admin and self.open - self.admins >= MAX_CONNECTIONS - ADMIN_RESERVED:
            return (f"non-admin peers hold {self.open - self.admins} connections, all but "
                    f"the {ADMIN_RESERVED} kept for admins")
        mine = self.by_uid.get(uid)
        if self.per_uid and mine is not None and len(mine) >= self.per_uid:
            return f"{len(mine)} open"
        self.by_uid.setdefault(uid, set()).add(conn)
        self.open += 1
        self.admins += admin
        return None

    def release(self, conn: C, uid: int, admin: bool) -> None:
        """`conn`, admitted, has closed."""
        mine = self.by_uid.get(uid)
        if mine is None or conn not in mine:
            return
        mine.discard(conn)
        if not mine:
            del self.by_uid[uid]
        self.open -= 1
        self.admins -= admin

    def of_uid(self, uid: int) -> set[C]:
        """The open connections of peer `uid`."""
        return self.by_uid.get(uid, set())
