"""Daemon configuration: one frozen dataclass, built once from TOML + flags.

Flags override the file; every value is validated here, at start, so the rest
of the daemon never re-checks it. Unknown keys in the file are an error (a typo
must not silently fall back to a default). Adding a key is one entry in
`_FIELDS` plus one field on `Config`.
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from blockcache_client.common import convert
from blockcache_client.common.tomlfile import read_toml
from blockcache_client.contract import protocol
from blockcache_client.contract.blockkey import check_volume_name
from blockcache_client.contract.cluster import ClusterConfig
from blockcache_client.contract.errors import ConfigError, InvalidKey

DEFAULT_DIR_SIZE = "10G"


@dataclass(frozen=True, slots=True)
class CacheDirConfig:
    """One cache dir: its absolute path, hard size limit, placement weight."""

    path: str
    size: int
    weight: int = 0  # 0 = use size

    @property
    def placement_weight(self) -> int:
        return self.weight or self.size


@dataclass(frozen=True, slots=True)
class VolumeAccess:
    """Who besides admins may put, list and evict one volume's blocks."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class Config:
    """Everything `blockcached` needs, validated."""

    cache_dirs: tuple[CacheDirConfig, ...]
    socket: str = field(default_factory=protocol.default_socket)
    socket_mode: int = 0o660
    socket_group: int | None = None  # None = the daemon's own gid
    admin_gids: frozenset[int] = frozenset()
    admin_uids: frozenset[int] = frozenset({0})  # [] = not even root is admin
    # [volumes.NAME] tables; empty with unlisted_volumes "open" = today's open host
    volumes: dict[str, VolumeAccess] = field(default_factory=dict)
    unlisted_volumes: str = "open"  # volumes without a table: "open" to all, or "admin" only
    # per peer uid (SO_PEERCRED); 0 = no limit. Connections: four uids at
    # the cap leave a fifth its whole share of what non-admins may hold
    # (connlimits.MAX_CONNECTIONS less ADMIN_RESERVED: 3,840)
    max_connections_per_uid: int = 768
    max_reply_bytes_per_uid: int = 64 << 20
    fill_queue_share: float = 0.5
    max_volumes: int = 4096  # distinct volume names indexed and counted at once
    # of them, how many one non-admin uid may bring in (volumeslots); four
    # uids at it leave a fifth its whole share. 0 = no per-uid limit
    max_volumes_per_uid: int = 800
    # fetch leases (leases.py): how long one lasts at most, 0 = none granted;
    # and how many one non-admin uid may hold (four uids at it leave a fifth
    # its whole share of the 14,336 non-admins may hold)
    lease_timeout: float = 2.0
    max_leases_per_uid: int = 2816
    high_watermark: float = 0.98
    low_watermark: float = 0.95
    min_free_bytes: int = 1 << 30
    min_free_inodes: int = 10000
    max_entries: int = 0  # 0 = no limit
    fill_queue_bytes: int = 256 << 20
    io_timeout: float = 5.0
    frame_timeout: float = 30.0  # a request must arrive whole within this (server.py)
    log_level: str = "info"
    log_format: str = "text"
    metrics_addr: str | None = None  # HOST:PORT of the Prometheus endpoint; None = off
    # which blocks a full dir keeps (policy.py): "tinylfu" (frequency-gated
    # admission) or "lru" (admit every block, evict the least recently used)
    admission_policy: str = "tinylfu"
    # (volume, max_bytes) from [volumes.NAME] tables: a volume's blocks never
    # take more than its max_bytes of the cache, summed over the dirs
    volume_quotas: tuple[tuple[str, int], ...] = ()
    # [cluster] / --memcached: the memcached pool readers share blocks
    # through, handed to them in `hello`; None = no cluster tier
    cluster: ClusterConfig | None = None


def _group(value: Any, what: str) -> int | None:
    if value in ("", None):
        return None
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value)
    try:
        return grp.getgrnam(str(value)).gr_gid
    except KeyError:
        raise ConfigError(f"{what}: no group named {value!r}; give an existing group name "
                          f"or gid") from None


def _user(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    try:
        return pwd.getpwnam(str(value)).pw_uid
    except KeyError:
        raise ConfigError(f"{what}: no user named {value!r}; give an existing user name "
                          f"or uid") from None


def _uids(value: Any, what: str) -> frozenset[int]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{what}: must be a list of users (names or uids)")
    return frozenset(_user(v, what) for v in value if v != "")  # --admin-uid '': none


def _gids(value: Any, what: str) -> frozenset[int]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{what}: must be a list of gids")
    out = set()
    for v in value:
        g = _group(v, what)
        if g is not None:
            out.add(g)
    return frozenset(out)


# file key -> (Config field, converter). Flags use the same converters.
_FIELDS: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "socket": ("socket", convert.path),
    "socket_mode": ("socket_mode", convert.mode),
    "socket_group": ("socket_group", _group),
    "admin_gids": ("admin_gids", _gids),
    "admin_uids": ("admin_uids", _uids),
    "unlisted_volumes": ("unlisted_volumes", convert.choice("open", "admin")),
    "max_connections_per_uid": ("max_connections_per_uid", convert.count),
    "max_reply_bytes_per_uid": ("max_reply_bytes_per_uid", convert.size),
    "fill_queue_share": ("fill_queue_share", convert.ratio),
    "max_volumes": ("max_volumes", convert.count),
    "max_volumes_per_uid": ("max_volumes_per_uid", convert.count),
    "high_watermark": ("high_watermark", convert.ratio),
    "low_watermark": ("low_watermark", convert.ratio),
    "min_free_bytes": ("min_free_bytes", convert.size),
    "min_free_inodes": ("min_free_inodes", convert.count),
    "max_entries": ("max_entries", convert.count),
    "fill_queue_bytes": ("fill_queue_bytes", convert.size),
    "io_timeout": ("io_timeout", convert.duration),
    "lease_timeout": ("lease_timeout", partial(convert.duration, allow_zero=True)),
    "max_leases_per_uid": ("max_leases_per_uid", convert.count),
    "frame_timeout": ("frame_timeout", convert.duration),
    "log_level": ("log_level", convert.choice("debug", "info", "warning", "error")),
    "log_format": ("log_format", convert.choice("text", "json")),
    "metrics_addr": ("metrics_addr", convert.address),
    "admission_policy": ("admission_policy", convert.choice("tinylfu", "lru")),
}
_DIR_KEYS = {"path", "size", "weight"}
_ACCESS_KEYS = {"uids", "gids"}
_QUOTA_KEYS = {"max_bytes"}


def parse_cache_dir_flag(text: str) -> CacheDirConfig:
    """`DIR[:SIZE]` from the command line."""
    path, sep, size = text.rpartition(":")
    if not sep or "/" in size or not size:
        path, size = text, DEFAULT_DIR_SIZE
    return _cache_dir({"path": path, "size": size}, f"--cache-dir {text}")


def _table(table: Any, allowed: set[str], what: str, shape: str) -> dict[str, Any]:
    """`table` if it is a TOML table holding only `allowed` keys."""
    if not isinstance(table, dict):
        raise ConfigError(f"{what}: {shape}")
    unknown = set(table) - allowed
    if unknown:
        raise ConfigError(f"{what}: unknown key(s) {', '.join(sorted(unknown))}; "
                          f"allowed: {', '.join(sorted(allowed))}")
    return table


def _cache_dir(table: Any, what: str) -> CacheDirConfig:
    _table(table, _DIR_KEYS, what, "each [[cache_dirs]] entry must be a table")
    if "path" not in table:
        raise ConfigError(f"{what}: 'path' is required")
    size = convert.size(table.get("size", DEFAULT_DIR_SIZE), f"{what}: size")
    if size <= 0:
        raise ConfigError(f"{what}: size must be more than 0")
    return CacheDirConfig(convert.path(table["path"], f"{what}: path"), size,
                          convert.count(table.get("weight", 0), f"{what}: weight"))


def _volume_tables(value: Any, what: str) -> dict[str, VolumeAccess]:
    """`[volumes.NAME]` tables: `uids` and `gids` that may use volume NAME (a
    table naming neither, only a quota, sets no access rule)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: must be tables, one per volume: [volumes.NAME]")
    out = {}
    for name, table in value.items():
        where = f"{what}.{name}"
        try:
            check_volume_name(name)
        except InvalidKey as exc:
            raise ConfigError(f"{where}: {exc}") from None
        _table(table, _ACCESS_KEYS | _QUOTA_KEYS, where,
               "must be a table with uids, gids and/or max_bytes")
        if not table:
            raise ConfigError(f"{where}: an empty table; give uids/gids (who may use the "
                              f"volume) and/or max_bytes (its quota, for example \"2T\")")
        if "uids" in table or "gids" in table:
            out[name] = VolumeAccess(_uids(table.get("uids", []), f"{where}: uids"),
                                     _gids(table.get("gids", []), f"{where}: gids"))
    return out


def _volume_quotas(tables: dict[str, Any], what: str) -> tuple[tuple[str, int], ...]:
    """`max_bytes = SIZE` of the `[volumes.NAME]` tables (checked by
    `_volume_tables`), as (name, bytes) pairs."""
    out = []
    for name, table in sorted(tables.items()):
        if "max_bytes" not in table:
            continue
        where = f"{what}.{name}"
        size = convert.size(table["max_bytes"], f"{where}: max_bytes")
        if size <= 0:
            raise ConfigError(f"{where}: max_bytes must be more than 0")
        out.append((name, size))
    return tuple(out)


def parse_volume_access_flag(text: str) -> tuple[str, VolumeAccess]:
    """`VOL=uid:1000,gid:train,...` from the command line (one volume's table)."""
    name, sep, spec = text.partition("=")
    what = f"--volume-access {text}"
    uids, gids = [], []
    for part in spec.split(",") if spec else []:
        kind, _, who = part.partition(":")
        if kind == "uid" and who:
            uids.append(who)
        elif kind == "gid" and who:
            gids.append(who)
        else:
            raise ConfigError(f"{what}: {part!r} is not uid:USER or gid:GROUP")
    if not sep:
        raise ConfigError(f"{what}: expected VOL=uid:USER,gid:GROUP,...")
    return next(iter(_volume_tables({name: {"uids": uids, "gids": gids}},
                                    "--volume-access").items()))


def _memcached_flag(value: str, file_cluster: ClusterConfig | None) -> ClusterConfig | None:
    """`--memcached HOST:PORT[,HOST:PORT...]` over the file's `[cluster]`
    (its timeouts and TLS files still apply); "" turns the tier off."""
    table = {} if file_cluster is None else file_cluster.to_wire()
    table["memcached"] = value
    return ClusterConfig.parse(table, "--memcached")


def load_file(path: str) -> dict[str, Any]:
    """Read a TOML config file into Config keyword arguments."""
    data = read_toml(path, [*_FIELDS, "cache_dirs", "volumes", "cluster"])
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "cache_dirs":
            if not isinstance(value, list):
                raise ConfigError(f"{path}: cache_dirs must be an array of tables ([[cache_dirs]])")
            out["cache_dirs"] = [_cache_dir(t, f"{path}: cache_dirs[{i}]")
                                 for i, t in enumerate(value)]
        elif key == "volumes":
            out["volumes"] = _volume_tables(value, f"{path}: volumes")
            out["volume_quotas"] = _volume_quotas(value, f"{path}: volumes")
        elif key == "cluster":
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: cluster must be a table ([cluster])")
            out["cluster"] = ClusterConfig.parse(value, f"{path}: [cluster]")
        else:
            name, conv = _FIELDS[key]
            out[name] = conv(value, f"{path}: {key}")
    return out


def build(file_values: dict[str, Any], flag_values: dict[str, Any]) -> Config:
    """Merge file and flag values (flags win) and validate the whole."""
    merged = {**file_values}
    for key, value in flag_values.items():
        if value is None or (key in ("cache_dirs", "volume_access") and not value):
            continue
        if key == "cache_dirs":
            merged[key] = value
        elif key == "volume_access":  # each flag adds (or replaces) one volume's table
            merged["volumes"] = {**merged.get("volumes", {}),
                                 **dict(map(parse_volume_access_flag, value))}
        elif key == "memcached":  # the servers; the file's other [cluster] keys stay
            merged["cluster"] = _memcached_flag(value, merged.get("cluster"))
        else:
            name, conv = _FIELDS[key]
            merged[name] = conv(value, f"--{key.replace('_', '-')}")
    dirs = merged.pop("cache_dirs", None)
    if not dirs:
        raise ConfigError("no cache dir configured: pass --cache-dir DIR[:SIZE] or add a "
                          "[[cache_dirs]] table to the config file")
    paths = [d.path for d in dirs]
    if len(set(paths)) != len(paths):
        raise ConfigError(f"a cache dir is listed twice: {paths}")
    for a in paths:
        for b in paths:
            if a != b and (b + os.sep).startswith(a + os.sep):
                raise ConfigError(f"cache dir {b} is inside cache dir {a}; use separate dirs")
    cfg = Config(cache_dirs=tuple(dirs), **merged)
    if cfg.low_watermark >= cfg.high_watermark:
        raise ConfigError(f"low watermark {cfg.low_watermark} must be below the high "
                          f"watermark {cfg.high_watermark}")
    if cfg.fill_queue_bytes <= 0:
        raise ConfigError("fill_queue_bytes must be more than 0")
    if cfg.max_volumes == 0:
        raise ConfigError("max_volumes must be at least 1 (it bounds per-volume state; "
                          "raise it if you cache more volumes at once)")
    return cfg
