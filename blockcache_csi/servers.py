"""Who a volume's FUSE server runs as.

Every server runs unprivileged. By default all of them run as one uid
(`--server-uid`); `--volume-uid NAME=UID[:GID]` gives blockcache volume NAME
a uid of its own, so that servers of different volumes can neither signal
nor trace each other, nor read each other's key files, and blockcached's
per-volume access tables and per-uid limits tell them apart. The map is the
operator's (the plugin's command line): a pod's volume attributes only name
the volume, never choose a uid.
"""

from __future__ import annotations

import logging
import os
import re
import stat

from blockcache_client.contract import protocol
from blockcache_client.contract.blockkey import check_volume_name
from blockcache_client.contract.errors import InvalidKey
from fsclient.keeper import Credentials

log = logging.getLogger(__name__)

_ENTRY = re.compile(r"(?P<volume>[^=]+)=(?P<uid>\d+)(?::(?P<gid>\d+))?")
MAX_ID = 2**32 - 2


class ServerUsersError(ValueError):
    """A --volume-uid entry that cannot be used; the message names it and the fix."""


def parse_volume_uid(entry: str) -> tuple[str, int, int]:
    """`NAME=UID[:GID]` -> (NAME, UID, GID); GID is UID when not given."""
    m = _ENTRY.fullmatch(entry)
    if m is None:
        raise ServerUsersError(f"--volume-uid {entry!r} is not VOLUME=UID or VOLUME=UID:GID "
                               f"(e.g. imagenet=20001)")
    try:
        check_volume_name(m["volume"])
    except InvalidKey as exc:
        raise ServerUsersError(f"--volume-uid {entry!r}: {exc}") from None
    uid = int(m["uid"])
    gid = int(m["gid"]) if m["gid"] is not None else uid
    if not 0 < uid <= MAX_ID or not 0 < gid <= MAX_ID:
        raise ServerUsersError(f"--volume-uid {entry!r}: a server never runs as root (0); "
                               f"give a uid and gid from 1 to {MAX_ID}")
    return m["volume"], uid, gid


class ServerUsers:
    """The uid and gid each volume's server runs as."""

    def __init__(self, uid: int, gid: int, volumes: dict[str, tuple[int, int]] | None = None):
        self.default = (uid, gid)
        self.volumes = dict(volumes or {})
        for name, ids in self.volumes.items():
            if ids[0] == uid:
                raise ServerUsersError(
                    f"--volume-uid {name}={ids[0]} is the uid every other volume's server "
                    f"runs as (--server-uid); give volume {name} a uid of its own")

    @classmethod
    def from_entries(cls, uid: int, gid: int, entries: tuple[str, ...]) -> ServerUsers:
        volumes: dict[str, tuple[int, int]] = {}
        for entry in entries:
            name, vuid, vgid = parse_volume_uid(entry)
            if name in volumes and volumes[name] != (vuid, vgid):
                raise ServerUsersError(f"--volume-uid gives volume {name} two uids; keep one")
            volumes[name] = (vuid, vgid)
        return cls(uid, gid, volumes)

    def ids(self, volume: str) -> tuple[int, int]:
        return self.volumes.get(volume, self.default)

    def credentials(self, volume: str, socket: str | None) -> Credentials:
        """The uid and gid of `volume`'s server, and the group of blockcached's
        socket, which it needs to connect (the socket is 0660 by default)."""
        uid, gid = self.ids(volume)
        path = socket or protocol.default_socket()
        groups: tuple[int, ...] = ()
        try:
            st = os.stat(path)
            if stat.S_ISSOCK(st.st_mode) and st.st_gid != gid:
                groups = (st.st_gid,)
        except OSError as exc:
            log.warning("blockcached's socket %s: %s; the server of volume %s gets no socket "
                        "group and reads uncached if the socket's mode shuts it out", path,
                        exc.strerror, volume)
        return Credentials(uid, gid, groups)
