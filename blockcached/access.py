"""Who may do what, from the peer's SO_PEERCRED credentials.

Admins (`admin_uids`, root by default, and `admin_gids`) may do everything.
Volume-scoped operations (put, list, evict by key or inode) of a volume
with a `[volumes.NAME]` table are for its `uids`/`gids`; a volume without
one is open to every peer (`unlisted_volumes = "open"`, the single-tenant
default) or for admins only ("admin"). Once any table exists or unlisted
volumes are closed, access is "configured": listing every volume's keys
then needs an admin too, `lookup` answers a miss and `touch` does nothing
for a key of a volume the peer may not use, and `stats` shows per-volume
figures (`volumes`, `cluster.volumes`) only of the volumes it may use.
`ping`, `hello` and the rest of `stats` stay open to every peer the socket
admits. Without tables, block names are keyed hashes (`contract.blockkey`)
that say nothing without the key, but volume names and counts are shown.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockcache_client.contract.errors import ProtocolError
from blockcache_client.contract.protocol import ErrorCode

from .config import Config


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is on the other end of a connection (from SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


class Access:
    """The access rules of one `Config`."""

    def __init__(self, cfg: Config):
        self.admin_uids = cfg.admin_uids
        self.admin_gids = cfg.admin_gids
        self.volumes = cfg.volumes
        self.unlisted_open = cfg.unlisted_volumes == "open"
        self.configured = bool(cfg.volumes) or not self.unlisted_open

    def is_admin(self, peer: Peer) -> bool:
        admin = self.admin_gids
        return (peer.uid in self.admin_uids or peer.gid in admin
                or any(g in admin for g in peer.groups))

    def may_use(self, peer: Peer, volume: str) -> bool:
        """Whether `peer` may put, list and evict blocks of `volume`."""
        rule = self.volumes.get(volume)
        if rule is None:
            return self.unlisted_open or self.is_admin(peer)
        return (peer.uid in rule.uids or peer.gid in rule.gids
                or any(g in rule.gids for g in peer.groups) or self.is_admin(peer))

    def require_admin(self, peer: Peer, what: str) -> None:
        if not self.is_admin(peer):
            raise ProtocolError(ErrorCode.PERMISSION_DENIED,
                                f"{what} needs an admin peer (a uid in admin_uids or a group "
                                f"in admin_gids); uid {peer.uid} gid {peer.gid} is not one")

    def require_volume(self, peer: Peer, volume: str, what: str) -> None:
        if not self.may_use(peer, volume):
            raise ProtocolError(ErrorCode.PERMISSION_DENIED,
                                f"{what}: uid {peer.uid} gid {peer.gid} may not use volume "
                                f"{volume!r}; add it to [volumes.{volume}] uids/gids in the "
                                f"daemon's config")
