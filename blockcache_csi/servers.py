"""Who a volume's FUSE server runs as: the operator's choice, never the pod's.

Every server runs unprivileged. By default all of them run as one uid
(`--server-uid`). The operator gives uids of their own by what a pod cannot
forge:

- `--namespace-uid NAMESPACE=UID[:GID]`: the volumes of pods in NAMESPACE,
  as the kubelet names it in `csi.storage.k8s.io/pod.namespace` (it
  overwrites any value the pod wrote there, with `podInfoOnMount: true`);
- `--pv-uid VOLUME_HANDLE=UID[:GID]`: a static PersistentVolume by its
  volumeHandle (the request's volume_id), which only whoever may create PVs
  chooses. It applies only when the kubelet says the volume is not an inline
  one (`csi.storage.k8s.io/ephemeral: "false"`): an inline volume's
  volume_id is the kubelet's `csi-<sha256(pod uid + volume name)>`.

A PV's entry wins over its namespace's. Servers of different uids can
neither signal nor trace each other, and blockcached's per-volume access
tables and per-uid limits tell them apart. No volume attribute of the pod
(`volume`, `source`...) chooses a uid.
"""

from __future__ import annotations

import logging
import os
import re
import stat

from blockcache_client.contract import protocol
from fsclient.keeper import Credentials

from .volumes import Publication

log = logging.getLogger(__name__)

_ENTRY = re.compile(r"(?P<name>[^=]+)=(?P<uid>\d+)(?::(?P<gid>\d+))?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
MAX_ID = 2**32 - 2
RETIRED_FLAG = ("--volume-uid was keyed by the pod's own volume_context[\"volume\"], which any "
                "pod can write; use --namespace-uid NAMESPACE=UID[:GID] (the pods' namespace) "
                "or --pv-uid VOLUME_HANDLE=UID[:GID] (a static PersistentVolume) instead")


class ServerUsersError(ValueError):
    """A uid entry that cannot be used; the message names it and the fix."""


def parse_entry(flag: str, entry: str) -> tuple[str, int, int]:
    """`NAME=UID[:GID]` -> (NAME, UID, GID); GID is UID when not given."""
    m = _ENTRY.fullmatch(entry)
    if m is None:
        raise ServerUsersError(f"{flag} {entry!r} is not NAME=UID or NAME=UID:GID "
                               f"(e.g. team-a=20001)")
    name = m["name"]
    if flag == "--namespace-uid" and not _NAMESPACE.fullmatch(name):
        raise ServerUsersError(f"{flag} {entry!r}: {name!r} is not a namespace name "
                               f"(a DNS label: a-z 0-9 -)")
    uid = int(m["uid"])
    gid = int(m["gid"]) if m["gid"] is not None else uid
    if not 0 < uid <= MAX_ID or not 0 < gid <= MAX_ID:
        raise ServerUsersError(f"{flag} {entry!r}: a server never runs as root (0); "
                               f"give a uid and gid from 1 to {MAX_ID}")
    return name, uid, gid


def _table(flag: str, entries: tuple[str, ...], default_uid: int) -> dict[str, tuple[int, int]]:
    table: dict[str, tuple[int, int]] = {}
    for entry in entries:
        name, uid, gid = parse_entry(flag, entry)
        if name in table and table[name] != (uid, gid):
            raise ServerUsersError(f"{flag} gives {name} two uids; keep one")
        if uid == default_uid:
            raise ServerUsersError(f"{flag} {entry!r}: {uid} is the uid every other "
                                   f"volume's server runs as (--server-uid); give {name} a "
                                   f"uid of its own")
        table[name] = (uid, gid)
    return table


class ServerUsers:
    """The uid and gid each volume's server runs as."""

    def __init__(self, uid: int, gid: int, namespaces: dict[str, tuple[int, int]] | None = None,
                 volumes: dict[str, tuple[int, int]] | None = None):
        self.default = (uid, gid)
        self.namespaces = dict(namespaces or {})
        self.volumes = dict(volumes or {})  # static PVs, by volume handle

    @classmethod
    def from_entries(cls, uid: int, gid: int, namespaces: tuple[str, ...] = (),
                     volumes: tuple[str, ...] = ()) -> ServerUsers:
        return cls(uid, gid, _table("--namespace-uid", namespaces, uid),
                   _table("--pv-uid", volumes, uid))

    def ids(self, pub: Publication) -> tuple[int, int]:
        if not pub.ephemeral and pub.volume_id in self.volumes:
            return self.volumes[pub.volume_id]
        return self.namespaces.get(pub.namespace, self.default)

    def credentials(self, pub: Publication, socket: str | None) -> Credentials:
        """The uid and gid of `pub`'s server, and the group of blockcached's
        socket, which it needs to connect (the socket is 0660 by default)."""
        uid, gid = self.ids(pub)
        volume = pub.volume_id
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
