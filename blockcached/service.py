"""Operation handlers: one request map in, one reply map out.

Exactly the operations `blockcache_client.contract.protocol` documents. Every key is
parsed with `BlockKey.parse` before anything builds a path from it, and every
put's blob is checked with `BlockHeader.parse` + `check_file_size`, so only
well-formed blocks under canonical names ever reach the disk.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from blockcache_client.common.metrics import Histogram
from blockcache_client.contract import blockfile, protocol
from blockcache_client.contract.blockkey import KEY_FORMAT, BlockKey, check_inode, check_volume_name
from blockcache_client.contract.errors import FormatError, InvalidKey, ProtocolError
from blockcache_client.contract.leases import MAX_LEASE_KEYS, NONE
from blockcache_client.contract.protocol import ErrorCode, arg, key_list

from .access import Access, Peer
from .cache import Cache
from .clusterstats import ClusterStats
from .config import Config
from .daemonarea import DaemonArea
from .leases import LeaseTable

log = logging.getLogger(__name__)

MAX_LIST = protocol.LIST_PAGE  # keys in one list reply: `after` asks for the next page
# ops whose handler also takes the connection (its fill area, its leases)
_CONNECTION_OPS = frozenset({"put", "area", "lease", "wait", "release"})
REFUSAL_LOG_EVERY = 60.0  # seconds between log lines per (refusal kind, uid)
# why a peer over its share was refused, and what the log line tells the operator
_REFUSALS = {
    "connections": "may not open another connection",
    "reply_bytes": "has max_reply_bytes_per_uid bytes of replies unread",
    "over_share": "holds its fill_queue_share of the fill queue",
    "too_many_volumes": "put a block of a new volume while max_volumes are cached",
    "volume_share": "put a block of a new volume while owning max_volumes_per_uid volumes",
    "read_budget": "holds its share of the read budget for large frames (the frame waits)",
    "lease_share": "holds max_leases_per_uid fetch leases (it fetches without more)",
}


class Refusals:
    """Requests refused because their peer was over its share: counted per
    kind (stats `refused`) and logged at most once a minute per kind and
    uid, so a flood cannot flood the log too."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._logged: dict[tuple[str, int], float] = {}

    def note(self, kind: str, peer: Peer, detail: str = "") -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        last = self._logged.get((kind, peer.uid))
        if last is not None and now - last < REFUSAL_LOG_EVERY:
            return
        if len(self._logged) > 4096:
            self._logged.clear()
        self._logged[(kind, peer.uid)] = now
        log.warning("refused uid %d (pid %d), which %s%s (%d such refusals so far)",
                    peer.uid, peer.pid, _REFUSALS[kind], f": {detail}" if detail else "",
                    self.counts[kind])


class Service:
    """Dispatches requests to the cache and counts outcomes."""

    def __init__(self, cfg: Config, cache: Cache):
        self.cfg = cfg
        self.cache = cache
        self.access = Access(cfg)
        self.leases = leases = LeaseTable(cfg.lease_timeout, cfg.max_leases_per_uid)
        cache.awaited = leases.awaited  # a block waited for is written eagerly
        cache.on_written = leases.written
        leases.landing = cache.fill.pending.__contains__
        self.refusals = Refusals()
        self.cluster = ClusterStats(cfg.cluster, cfg.max_volumes)
        self.errors: dict[str, int] = {}
        self.requests: dict[str, int] = {}
        self.connections = 0
        self.connections_total = 0
        self.fill_areas = {"opened": 0, "puts": 0}  # shared-memory hand-offs (fillarea)
        self.started = time.time()
        self._uid = os.geteuid()  # owns every file it writes; readers check it (hello)
        # request handling time per op; set by __main__ when metrics are on
        self.latency: Histogram | None = None
        self._ops: dict[str, Callable[[dict[str, Any], Peer], dict[str, Any]]] = {
            "hello": self.hello, "ping": self.ping, "lookup": self.lookup, "put": self.put,
            "touch": self.touch, "evict": self.evict, "list": self.list, "stats": self.stats,
            "area": self.area, "lease": self.lease, "wait": self.wait, "release": self.release,
        }

    def count_error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def handle(self, body: dict[str, Any], peer: Peer, conn: Any = None) -> dict[str, Any] | None:
        """Answer one request whose id is already known to be valid; None:
        a `wait`, answered later by `conn.answer_later`. `conn` (the server's
        connection) holds the connection's fill area, if any (`area` sets
        it, `put` reads from it), and is what holds leases and waits."""
        self.cache.finish_writes()
        latency = self.latency
        if latency is None:
            return self._handle(body, peer, conn)
        start = time.perf_counter()
        reply = self._handle(body, peer, conn)
        op = body.get("op")
        known = isinstance(op, str) and op in self._ops  # op may be any msgpack value
        latency.observe(op if known else "unknown", time.perf_counter() - start)
        return reply

    def _handle(self, body: dict[str, Any], peer: Peer, conn: Any) -> dict[str, Any] | None:
        rid = body["id"]
        op = body.get("op")
        handler = self._ops.get(op) if isinstance(op, str) else None
        if handler is None:
            self.count_error(ErrorCode.UNKNOWN_OP)
            # the op may be any msgpack value of up to MAX_FRAME bytes: never
            # repr it whole (a 16 MiB op made a reply over the frame limit)
            shown = (repr(op) if isinstance(op, str) and len(op) <= 64
                     else f"of type {type(op).__name__}")
            return protocol.error(rid, ErrorCode.UNKNOWN_OP,
                                  f"unknown op {shown}; known: {', '.join(protocol.OPS)}")
        self.requests[op] = self.requests.get(op, 0) + 1
        try:
            result = handler(body, peer, conn) if op in _CONNECTION_OPS else handler(body, peer)
            return None if result is None else protocol.ok(rid, **result)
        except ProtocolError as exc:
            code, message = exc.code, exc.message
        except InvalidKey as exc:
            code, message = ErrorCode.INVALID_KEY, str(exc)
        except FormatError as exc:
            code, message = ErrorCode.INVALID_BLOCK, f"put rejected: {exc}"
        except Exception:  # a bug must cost one request, not the daemon
            log.exception("op %s failed", op)
            code = ErrorCode.INTERNAL
            message = f"internal error handling {op!r}; see the daemon log"
        self.count_error(code)
        return protocol.error(rid, code, message)

    # -- operations --------------------------------------------------------

    def hello(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        version = arg(body, "version", int)
        arg(body, "client", str, required=False)
        if version != protocol.PROTOCOL_VERSION:
            raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                                f"protocol version {version} is not supported; this daemon "
                                f"speaks version {protocol.PROTOCOL_VERSION}: upgrade the "
                                f"older side")
        reply = {"version": protocol.PROTOCOL_VERSION, "layout": self.cache.layout.to_wire(),
                 "layout_epoch": self.cache.epoch, "max_frame": protocol.MAX_FRAME,
                 "max_batch": protocol.MAX_BATCH, "key_format": KEY_FORMAT,
                 "uid": self._uid, "lease_timeout": self.leases.timeout}
        cluster = self.cache.cfg.cluster
        if cluster is not None:  # readers talk to the pool themselves
            reply["cluster"] = cluster.to_wire()
        return reply

    def ping(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        self._cluster_report(body, peer)
        return {"time": time.time(), "layout_epoch": self.cache.epoch}

    def _cluster_report(self, body: dict[str, Any], peer: Peer) -> None:
        """A reader's cluster tier counters, riding on its ping or touch."""
        report = body.get("cluster")
        if report is not None:
            self.cluster.note(report, lambda vol: self.access.may_use(peer, vol))

    def lookup(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        keys = _parsed(key_list(body), self.cache.index.__contains__)
        usable = self._usable(peer)
        if usable is None:
            return {"paths": self.cache.lookup(keys)}
        # another tenant's key is a miss: its block's existence is not ours to tell
        mine = [k for k in keys if usable(k)]
        found = dict(zip(mine, self.cache.lookup(mine)))
        return {"paths": [found.get(k) for k in keys]}

    def _usable(self, peer: Peer) -> Callable[[str], bool] | None:
        """Whether `peer` may use each (parsed) key's volume, asked once per
        volume; None when it may use every volume (no access tables, or an
        admin): the common case costs nothing per key."""
        access = self.access
        if not access.configured or access.is_admin(peer):
            return None
        volumes: dict[str, bool] = {}

        def usable(key: str) -> bool:
            vol = key[:key.index("_")]
            ok = volumes.get(vol)
            if ok is None:
                ok = volumes[vol] = access.may_use(peer, vol)
            return ok

        return usable

    def put(self, body: dict[str, Any], peer: Peer, conn: Any = None) -> dict[str, Any]:
        key = arg(body, "key", str)
        span = None
        if "area" in body:  # the block is in a slot of the connection's fill area
            area: DaemonArea | None = getattr(conn, "area", None)
            slot = arg(body, "area", int)
            if area is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST,
                                    f"put of {key} names fill area slot {slot}, but this "
                                    f"connection has no fill area: ask for one (area op) first")
            data = span = area.span(slot, arg(body, "size", int))
            self.fill_areas["puts"] += 1
        else:
            data = body.get("data")
            if not isinstance(data, memoryview):  # a big block arrives as a view of its frame
                data = arg(body, "data", bytes)
        accepted = False
        try:
            vol = BlockKey.parse(key).vol
            self.access.require_volume(peer, vol, f"put of {key}")
            header = blockfile.BlockHeader.parse(
                data if span is None else span.head(blockfile.HEADER_SIZE))
            header.check_file_size(len(data))
            accepted, reason = self.cache.put(key, data, peer.uid, self.access.is_admin(peer))
            self.leases.put_answered(key, reason)
        finally:
            if span is not None and not accepted:  # never queued: its slot is free now
                span.release()
        if reason == "volume_share":
            self.refusals.note(reason, peer, f"{key} (it owns {self.cfg.max_volumes_per_uid}; "
                                             f"raise max_volumes_per_uid, or evict its volumes)")
        elif reason in _REFUSALS:
            self.refusals.note(reason, peer, key)
        return {"accepted": accepted, "reason": reason}

    def area(self, body: dict[str, Any], peer: Peer, conn: Any) -> dict[str, Any]:
        """Open this connection's fill area; the server passes its memfd
        with the reply (contract/fillarea.py)."""
        slots = arg(body, "slots", int)
        slot_bytes = arg(body, "slot_bytes", int)
        if conn is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "fill areas are for socket connections")
        if conn.area is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                "this connection has a fill area already: one per connection")
        try:
            conn.area = DaemonArea(slots, slot_bytes)
        except OSError as exc:
            log.warning("cannot create a fill area for uid %d: %s", peer.uid, exc)
            raise ProtocolError(ErrorCode.INTERNAL,
                                f"cannot create a fill area: {exc}; put blocks by value") from None
        self.fill_areas["opened"] += 1
        return {"slots": conn.area.slots, "slot_bytes": conn.area.slot_bytes}

    def lease(self, body: dict[str, Any], peer: Peer, conn: Any) -> dict[str, Any]:
        """Leases on a run of blocks for this connection (contract/leases.py)."""
        keys = self._lease_keys(body, peer, conn, "a fetch lease on")
        states = self.leases.take(keys, conn, peer.uid, self.access.is_admin(peer),
                                  self.cache.holds)
        if self.leases.enabled and NONE in states:
            self.refusals.note("lease_share", peer, f"{self.leases.per_uid} held")
        return {"states": states}

    def wait(self, body: dict[str, Any], peer: Peer, conn: Any) -> dict[str, Any] | None:
        """How a block's lease ended; None: answered when it ends."""
        key = arg(body, "key", str)
        self._lease_keys({"keys": [key]}, peer, conn, "waiting for")
        outcome = self.leases.wait(key, conn, partial(conn.answer_later, body["id"]),
                                   self.cache.holds)
        return None if outcome is None else {"outcome": outcome}

    def release(self, body: dict[str, Any], peer: Peer, conn: Any) -> dict[str, Any]:
        keys = self._lease_keys(body, peer, conn, "releasing the lease on")
        return {"released": self.leases.release(keys, conn)}

    def _lease_keys(self, body: dict[str, Any], peer: Peer, conn: Any, what: str) -> list[str]:
        """The keys of a lease op, parsed, of volumes the peer may use (a
        lease is a fetch's: the daemon's access rules for puts apply)."""
        if conn is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "leases are for socket connections")
        keys = _parsed(key_list(body), self.cache.index.__contains__)
        if len(keys) > MAX_LEASE_KEYS:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"'keys' has {len(keys)} entries; a lease takes at most "
                                f"{MAX_LEASE_KEYS}: ask for the rest in another")
        usable = self._usable(peer)
        if usable is not None:
            for key in keys:
                if not usable(key):
                    self.access.require_volume(peer, key[:key.index("_")], f"{what} {key}")
        return keys

    def touch(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        keys = _parsed(key_list(body), self.cache.index.__contains__)
        self._cluster_report(body, peer)
        usable = self._usable(peer)
        if usable is not None:  # another tenant's blocks keep their recency
            keys = [k for k in keys if usable(k)]
        return {"touched": self.cache.touch(keys), "layout_epoch": self.cache.epoch}

    def evict(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        key = arg(body, "key", str, required=False)
        volume = arg(body, "volume", str, required=False)
        inode = arg(body, "inode", int, required=False)
        everything = arg(body, "all", bool, required=False, default=False)
        scopes = (key is not None) + (volume is not None) + bool(everything)
        if scopes != 1 or (inode is not None and volume is None):
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                "evict takes exactly one of: key, volume (with an optional "
                                "inode), all=true")
        if key is not None:
            self.access.require_volume(peer, BlockKey.parse(key).vol, f"evicting {key}")
            return {"evicted": self.cache.evict_key(key)}
        if volume is not None:
            check_volume_name(volume)
            if inode is not None:
                check_inode(inode)
                self.access.require_volume(peer, volume, f"evicting inode {inode} of {volume!r}")
                return {"evicted": self.cache.evict_prefix(volume, inode)}
            self.access.require_admin(peer, f"evicting volume {volume!r}")
            return {"evicted": self.cache.evict_prefix(volume)}
        self.access.require_admin(peer, "evicting everything")
        return {"evicted": self.cache.evict_prefix(None)}

    def list(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        volume = arg(body, "volume", (str, type(None)), required=False)
        limit = arg(body, "limit", int, required=False, default=1000)
        after = arg(body, "after", (str, type(None)), required=False)
        if not 0 <= limit <= MAX_LIST:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"'limit' must be in 0..{MAX_LIST}; ask for further pages "
                                f"with 'after' = the last key of the previous one")
        if after is not None:
            BlockKey.parse(after)
        if volume is not None:
            check_volume_name(volume)
            self.access.require_volume(peer, volume, f"listing volume {volume!r}")
        elif self.access.configured:
            self.access.require_admin(peer, "listing every volume's keys")
        keys, truncated = self.cache.list_keys(volume, limit, after)
        return {"keys": keys, "truncated": truncated}

    def stats(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        s = self.cache.stats()
        s["connections"] = self.connections
        s["connections_total"] = self.connections_total
        s["requests"] = dict(self.requests)
        s["errors"] = dict(self.errors)
        s["bad_requests"] = sum(self.errors.values())
        s["refused"] = dict(self.refusals.counts)
        s["uptime"] = round(time.time() - self.started, 3)
        s["cluster"] = self.cluster.stats()
        s["fill_areas"] = dict(self.fill_areas)
        s["leases"] = self.leases.stats()
        if self.access.configured and not self.access.is_admin(peer):
            # per-volume figures of the volumes the peer may use only
            for part in (s, s["cluster"]):
                part["volumes"] = {v: figures for v, figures in part["volumes"].items()
                                   if self.access.may_use(peer, v)}
        return s


def _parsed(keys: list[str], known: Callable[[str], bool]) -> list[str]:
    """`keys`, each canonical, else InvalidKey. A key the index holds was
    parsed when it was admitted, so only the others pay for parsing again."""
    parse = BlockKey.parse
    for k in keys:
        if not known(k):
            parse(k)
    return keys
