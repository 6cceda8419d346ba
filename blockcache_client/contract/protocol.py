"""The wire protocol between readers and `blockcached`.

Transport: a unix stream socket. Each message is one frame:

    offset size  field
    0      4     length N of the body, big-endian u32, 1 .. MAX_FRAME
    4      N     body: one msgpack map (see `wire`)

Request bodies:  {"id": u32, "op": str, ...arguments}
Reply bodies:    {"id": u32, "ok": true, ...result}
                 {"id": u32, "ok": false, "code": ErrorCode, "message": str}

Replies carry the request's id, so one connection may pipeline: a client can
send many requests before reading replies, and the daemon may answer them out
of order. (Today's daemon answers each connection in order; a `wait` holds
back the requests behind it until it is answered.) A frame the daemon
cannot parse gets a reply with id 0 and the connection is closed (its
framing can no longer be trusted).

Operations (arguments -> result), protocol version 1:

    hello   version:int, client:str        -> version, layout (see `layout`),
                                              layout_epoch, max_frame, max_batch,
                                              key_format (keys.KEY_FORMAT),
                                              uid (the daemon's: owner of every
                                              block file; readers open no other),
                                              cluster (contract.cluster, only
                                              when a memcached pool is set)
    ping    cluster (optional, see below)  -> time:float, layout_epoch
    lookup  keys:[str]                     -> paths:[str|None] (absolute path of
                                              each key's block file, None = miss)
    put     key:str, data:bin              -> accepted:bool, reason:str
            | key:str, area:int, size:int     (answered before the write happens;
                                              `area`: the block is the first
                                              `size` bytes of that slot of the
                                              connection's fill area)
    touch   keys:[str], cluster (optional) -> touched:int, layout_epoch
    evict   key:str | volume:str [inode:int] | all:true  -> evicted:int
    list    volume:str|None, limit:int,    -> keys:[str], truncated:bool
            after:str (optional)              (one page: up to LIST_PAGE keys
                                              sorting after `after`)
    stats   -                              -> the stats map (see blockcached)
    area    slots:int, slot_bytes:int      -> slots, slot_bytes (rounded up to
                                              pages): this connection's fill
                                              area, its memfd passed with the
                                              reply (SCM_RIGHTS); see fillarea
    lease   keys:[str]                     -> states:[str]  fetch leases: see
    wait    key:str                        -> outcome:str   `leases` (hello also
    release keys:[str]                     -> released:int  names lease_timeout)

`cluster` in a ping or touch is a reader's report for the daemon's stats:
{volume:str, counters:{cluster_hits:int, ...}}, the growth of its cluster
tier counters since its last delivered report (readers talk to memcached
themselves, so the daemon sees the tier only this way).

`layout_epoch` changes whenever the cache layout a reader relies on changes
(a dir becomes unhealthy or healthy again); a reader seeing a new epoch asks
`hello` again.
"""

from __future__ import annotations

import struct
from typing import Any

from . import wire
from .errors import ProtocolError

# hello's `version`: the daemon refuses any other. Bump it when a side could
# misread the other: 2 = hello names `key_format` and `uid`, and `area` ops
PROTOCOL_VERSION = 2
LENGTH = struct.Struct(">I")
# A put carries one block file: up to blockfile.MAX_PLAINTEXT (16 MiB) plus
# header and tags; the rest is headroom for the map around it.
MAX_FRAME = 17 << 20
MAX_BATCH = 4096  # keys in one lookup / touch
LIST_PAGE = 10_000  # most keys in one list reply (~1.3 MB); `after` pages on
# bin values this large (a put's block) are sent and received without copies
VIEW_MIN = 64 << 10
# What the daemon decodes from anyone: a request is a map of scalars, at
# most one array of MAX_BATCH keys and the `cluster` report (a map of a map),
# so a request of more containers or longer ones is refused as it is decoded
# (`wire.unpack`), and one over SHAPED_MAX (a lookup of MAX_BATCH of the
# longest keys is 0.55 MiB) must be a flat map of scalars: a put.
# Counting containers costs ~1 us a request, so frames up to COUNTED_FROM
# (every small request) skip it: one can make at most 4 Ki objects anyway.
REQUEST_MAX_CONTAINERS = 8
COUNTED_FROM = 4 << 10
SHAPED_MAX = 1 << 20
DEFAULT_SOCKET = "/run/blockcache/blockcached.sock"
SOCKET_ENV = "BLOCKCACHE_SOCKET"


class ErrorCode:
    """Codes in error replies. Clients branch on these, never on messages."""

    BAD_FRAME = "bad_frame"                  # not msgpack, not a map, truncated
    FRAME_TOO_LARGE = "frame_too_large"      # length prefix over MAX_FRAME
    BAD_REQUEST = "bad_request"              # missing/mistyped argument
    UNKNOWN_OP = "unknown_op"
    UNSUPPORTED_VERSION = "unsupported_version"
    INVALID_KEY = "invalid_key"              # not a canonical block key
    INVALID_BLOCK = "invalid_block"          # put whose header or length is wrong
    PERMISSION_DENIED = "permission_denied"  # admin op from a non-admin peer, or a
                                             # volume op from a peer its access omits
    BUSY = "busy"                            # the peer's uid has too many reply bytes unread
    INTERNAL = "internal"


OPS = ("hello", "ping", "lookup", "put", "touch", "evict", "list", "stats", "area", "lease",
       "wait", "release")
ADMIN_EVICTIONS = ("volume", "all")  # evict scopes that need an admin peer


def default_socket() -> str:
    """The socket path every command uses unless told otherwise."""
    import os
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def encode_frame(body: dict[str, Any]) -> bytes:
    """One frame: length prefix + msgpack body. ProtocolError if too large."""
    data = wire.pack(body)
    return _prefix(len(data)) + data


def frame_parts(body: dict[str, Any]) -> list[bytes | memoryview]:
    """`encode_frame` as parts for a gathering send (their concatenation is
    the frame): the length prefix, then the body with every bin value of
    `VIEW_MIN` bytes or more a part of its own, not copied (a put's block is
    up to 16 MiB)."""
    parts = wire.pack_parts(body, VIEW_MIN)
    return [_prefix(sum(map(len, parts))), *parts]


def _prefix(n: int) -> bytes:
    if n > MAX_FRAME:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE,
                            f"message of {n} bytes exceeds the {MAX_FRAME}-byte frame limit")
    return LENGTH.pack(n)


def frame_length(prefix: bytes) -> int:
    """Validate a 4-byte length prefix and return the body length."""
    (n,) = LENGTH.unpack(prefix)
    if n == 0:
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame of length 0")
    if n > MAX_FRAME:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE,
                            f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    return n


def decode_body(data: bytes | memoryview, views: bool = False) -> dict[str, Any]:
    """Unpack a frame body; it must be a map with string keys. With `views`,
    bin values of `VIEW_MIN` bytes or more in a flat map (every request's
    shape) come back as memoryviews of `data`, not copies: `data` must then
    stay unchanged while they are in use."""
    body = wire.unpack_views(memoryview(data), MAX_FRAME, VIEW_MIN) if views else None
    if body is None:
        body = wire.unpack(data, MAX_FRAME)
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME,
                            f"frame body must be a msgpack map, not {type(body).__name__}")
    return body


def decode_request(data: bytes | memoryview, views: bool = False) -> dict[str, Any]:
    """`decode_body` for a request from a peer the daemon need not trust: its
    cost is bounded by its size (see `REQUEST_MAX_CONTAINERS`, `SHAPED_MAX`).
    ProtocolError (BAD_FRAME) naming what is wrong."""
    body = None
    if views or len(data) > SHAPED_MAX:
        body = wire.unpack_views(memoryview(data), MAX_FRAME, VIEW_MIN if views else MAX_FRAME)
    if body is None:
        if len(data) > SHAPED_MAX:
            raise ProtocolError(ErrorCode.BAD_FRAME,
                                f"a request of {len(data)} bytes must be a flat map of scalars "
                                f"(a put); only those up to {SHAPED_MAX} bytes may hold arrays "
                                f"or maps")
        body = wire.unpack(data, MAX_FRAME, MAX_BATCH,
                           REQUEST_MAX_CONTAINERS if len(data) > COUNTED_FROM else None)
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME,
                            f"frame body must be a msgpack map, not {type(body).__name__}")
    return body


def request_id(body: dict[str, Any]) -> int:
    rid = body.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 < rid < 2**32:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "request 'id' must be an integer in 1..2**32-1")
    return rid


def ok(rid: int, **result: Any) -> dict[str, Any]:
    return {"id": rid, "ok": True, **result}


def error(rid: int, code: str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "code": code, "message": message}


# -- argument checks shared by the daemon and the client ---------------------

def arg(body: dict[str, Any], name: str, kind: type | tuple[type, ...], *,
        required: bool = True, default: Any = None) -> Any:
    """Fetch a typed argument; ProtocolError(BAD_REQUEST) names it if wrong."""
    if name not in body:
        if required:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"'{name}' is required for op "
                                                       f"{body.get('op')!r}")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        value_ok = False
    else:
        value_ok = isinstance(value, kinds)
    if not value_ok:
        names = "/".join(k.__name__ for k in kinds)
        raise ProtocolError(ErrorCode.BAD_REQUEST,
                            f"'{name}' must be {names}, not {type(value).__name__}")
    return value


def key_list(body: dict[str, Any], name: str = "keys") -> list[str]:
    """A batch of key strings, bounded by MAX_BATCH (not yet parsed as keys)."""
    keys = arg(body, name, list)
    if len(keys) > MAX_BATCH:
        raise ProtocolError(ErrorCode.BAD_REQUEST,
                            f"'{name}' has {len(keys)} entries; the limit is {MAX_BATCH} "
                            f"per request")
    for k in keys:
        if not isinstance(k, str):
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"'{name}' must hold strings, not {type(k).__name__}")
    return keys
