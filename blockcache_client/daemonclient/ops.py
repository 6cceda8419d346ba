"""The protocol's operations, written once for both socket clients.

Each client supplies `_call`; `AsyncClient`'s returns an awaitable, so
`await aclient.lookup(keys)` and `client.lookup(keys)` read alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..contract import protocol
from ..contract.errors import DaemonError


class DaemonOps:
    """The protocol's operations, over an abstract `_call`."""

    def _call(self, op: str, args: dict[str, Any], pick: str | None = None) -> Any:
        raise NotImplementedError

    def hello(self, client: str = "blockcache_client"):
        """Protocol version, cache layout and limits (the whole reply map)."""
        return self._call("hello", {"version": protocol.PROTOCOL_VERSION, "client": client})

    def ping(self, cluster: dict[str, Any] | None = None):
        """`cluster`: a reader's cluster tier counters since its last report."""
        return self._call("ping", {} if cluster is None else {"cluster": cluster})

    def lookup(self, keys: Iterable[Any]):
        """Absolute block file path per key, None for a miss."""
        return self._call("lookup", {"keys": [str(k) for k in keys]}, "paths")

    def put(self, key: Any, blob: bytes):
        """Hand a sealed block file to the daemon; returns (accepted, reason)."""
        data = blob if isinstance(blob, (bytes, bytearray, memoryview)) else bytes(blob)
        return self._call("put", {"key": str(key), "data": data}, "_put")

    def touch(self, keys: Iterable[Any], cluster: dict[str, Any] | None = None):
        """Report accesses (keeps LRU order right), and `cluster` as `ping`;
        returns the reply map."""
        args: dict[str, Any] = {"keys": [str(k) for k in keys]}
        if cluster is not None:
            args["cluster"] = cluster
        return self._call("touch", args)

    def evict(self, key: Any = None, *, inode: tuple[str, int] | None = None,
              volume: str | None = None, all_: bool = False):
        """Evict one key, one inode (vol, inode), a volume, or everything.
        Returns the number of blocks evicted."""
        scopes = [key is not None, inode is not None, volume is not None, bool(all_)]
        if sum(scopes) != 1:
            raise ValueError("evict takes exactly one of key=, inode=, volume=, all_=True")
        if key is not None:
            args: dict[str, Any] = {"key": str(key)}
        elif inode is not None:
            args = {"volume": inode[0], "inode": int(inode[1])}
        elif volume is not None:
            args = {"volume": volume}
        else:
            args = {"all": True}
        return self._call("evict", args, "evicted")

    def list(self, volume: str | None = None, limit: int = 1000, after: str | None = None):
        """One page of cached keys (sorted), of one volume or all, after the
        key `after`; the reply map (`truncated`: more follow)."""
        args: dict[str, Any] = {"volume": volume, "limit": int(limit)}
        if after is not None:
            args["after"] = after
        return self._call("list", args)

    def list_all(self, volume: str | None = None, limit: int | None = None,
                 page: int = protocol.LIST_PAGE) -> list[str]:
        """Every cached key (of one volume or all), or the first `limit`,
        fetched a page at a time."""
        keys: list[str] = []
        after = None
        while limit is None or len(keys) < limit:
            want = page if limit is None else min(page, limit - len(keys))
            reply = self.list(volume, want, after)
            keys += reply["keys"]
            if not reply["truncated"] or not reply["keys"]:
                break
            after = reply["keys"][-1]
        return keys

    def stats(self):
        return self._call("stats", {})

    def lease(self, keys: Iterable[Any]):
        """Fetch leases on a run of blocks for this connection: one state
        per key (`contract.leases`)."""
        return self._call("lease", {"keys": [str(k) for k in keys]}, "states")

    def wait(self, key: Any):
        """How the lease on `key` ended (`contract.leases` outcomes); the
        reply comes when it ends, up to the daemon's `lease_timeout`: the
        client's timeout must be longer."""
        return self._call("wait", {"key": str(key)}, "outcome")

    def release(self, keys: Iterable[Any]):
        """End this connection's leases on `keys`; how many it held."""
        return self._call("release", {"keys": [str(k) for k in keys]}, "released")


def result_of(reply: dict[str, Any], pick: str | None) -> Any:
    if not reply.get("ok"):
        raise DaemonError(str(reply.get("code", protocol.ErrorCode.INTERNAL)),
                          str(reply.get("message", "daemon error without a message")))
    if pick is None:
        return reply
    if pick == "_put":
        return bool(reply.get("accepted")), str(reply.get("reason", ""))
    return reply[pick]
