"""Mount configuration: one frozen `MountConfig`, from a volume TOML file plus flags.

The TOML file (what `fsclient@.service` reads from
`/etc/blockcache/volumes/NAME.toml`) holds the same settings as the flags;
a flag given on the command line wins over the file. Unknown keys are an
error, never ignored, so a typo cannot silently change caching behaviour.

    volume = "imagenet"
    source = "s3://bucket/prefix"
    mountpoint = "/mnt/imagenet"
    key_file = "/etc/blockcache/keys/imagenet.key"
    socket = "/run/blockcache/blockcached.sock"
    block_size = "4M"
    meta_ttl = 60.0            # seconds, default for every prefix
    allow_other = false
    readahead_blocks = 2
    store_pages = true         # random reads put their chunk's other pages in the page cache
    max_nodes = 50000          # files and dirs tracked at once; past it the kernel forgets some
    options = []               # extra FUSE mount options (-o)
    metrics_addr = "127.0.0.1:9102"   # Prometheus endpoint of this mount (default: off)
    server_user = "65534:65534"       # root mounts, the server runs as UID:GID (default: as is)
    server_groups = [10001]           # its supplementary groups (blockcached's socket group)
    writable = false           # accept writes: staged on the node, uploaded whole on close
    staging_dir = "/var/tmp"   # where files being written are staged (writable mounts)
    staging_bytes = "16G"      # the most staged bytes at once; past it a write gets ENOSPC
    write_access = "owner"     # who may write: the server's uid ("owner"), or every uid ("all")
    [dir_ttl]                  # per directory prefix, longest match wins
    "code/" = 0
    [storage_options]          # passed to fsspec as they are
    endpoint_url = "http://127.0.0.1:9000"

A `dir_ttl` prefix names a directory inside the volume (a leading or trailing
'/' is optional): it covers that directory and everything beneath it. Its TTL
bounds the metadata cache, sets the kernel's entry/attr timeouts and decides
whether an open may keep the kernel page cache (only when TTL > 0).

A mount is read-only (mounted `ro`, every write answered EROFS) unless
`writable = true` (`--writable`): see fsclient/DESIGN.md, "Writable mounts".
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from blockcache_client.common import convert
from blockcache_client.common.tomlfile import read_toml
from blockcache_client.contract.blockkey import check_volume_name
from blockcache_client.contract.errors import ConfigError, InvalidKey
from blockcache_client.writer.staging import DEFAULT_LIMIT as DEFAULT_STAGING_BYTES

from .keeper.privileges import Credentials
from .session.mount import check_options as check_mount_options

DEFAULT_BLOCK_SIZE = 4 << 20
# Nodes (files and dirs the kernel holds) a server tracks at once: its memory
# bound (fsclient/DESIGN.md, "Memory is bounded") is built on it.
DEFAULT_MAX_NODES = 50_000
DEFAULT_META_TTL = 60.0
# Block sizes the reader supports: at least 64 KiB (one AEAD chunk), at most 16 MiB
# (blockfile.MAX_PLAINTEXT), so one block always fits one put frame.
MIN_BLOCK_SIZE = 64 << 10
MAX_BLOCK_SIZE = 16 << 20
WRITE_ACCESS = ("owner", "all")
# Options we set ourselves, or that would make the mount writable (`writable`
# does, with the writes it needs) or unsafe.
_RESERVED_OPTIONS = {"rw", "fsname", "subtype"}
# a comma not inside double quotes (an even number of quotes follows it)
_QUOTED_COMMA = re.compile(r',(?=(?:[^"]*"[^"]*")*[^"]*$)')


@dataclass(frozen=True)
class TtlPolicy:
    """Metadata TTL per directory prefix; the longest matching prefix wins.

    `prefixes` holds (prefix, ttl) with prefix put in "dir/" form, sorted
    longest first, so `ttl_for` is a short scan (there are few prefixes).
    """

    default: float = DEFAULT_META_TTL
    prefixes: tuple[tuple[str, float], ...] = ()

    @classmethod
    def build(cls, default: float, prefixes: Mapping[str, float]) -> TtlPolicy:
        norm: dict[str, float] = {}
        for prefix, ttl in prefixes.items():
            p = prefix.strip("/")
            ttl = _check_ttl(ttl, f"dir_ttl[{prefix!r}]")
            if not p:
                default = ttl
                continue
            norm[p + "/"] = ttl
        ordered = tuple(sorted(norm.items(), key=lambda kv: (-len(kv[0]), kv[0])))
        return cls(_check_ttl(default, "meta_ttl"), ordered)

    def ttl_for(self, path: str) -> float:
        """TTL for a volume-relative path (no leading '/'; "" is the root)."""
        if self.prefixes:
            probe = path + "/"
            for prefix, ttl in self.prefixes:
                if probe.startswith(prefix):
                    return ttl
        return self.default


def _check_ttl(value: Any, what: str) -> float:
    return convert.duration(value, what, allow_zero=True)


@dataclass(frozen=True)
class MountConfig:
    """Everything one mount needs, validated once at start."""

    volume: str
    source: str
    mountpoint: str
    key_file: str | None  # None: the key comes as `key_fd` only
    socket: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    ttl: TtlPolicy = field(default_factory=TtlPolicy)
    allow_other: bool = False
    readahead_blocks: int = 2
    options: tuple[str, ...] = ()
    storage_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    memory_cache_bytes: int = 64 << 20
    fill_queue_bytes: int = 256 << 20
    # Bounds of the in-process metadata caches (entries, LRU).
    meta_cache_entries: int = 200_000
    threads: int = 1  # FUSE worker threads (each answers the requests it reads; waits move off)
    # random reads hand their chunks' other pages to the page cache (`pagestore`;
    # a child process writes them, so a killed server never waits on one)
    store_pages: bool = True
    # nodes tracked at once, at most: past it the kernel is asked to forget (`pruner`)
    max_nodes: int = DEFAULT_MAX_NODES
    metrics_addr: str | None = None  # HOST:PORT of this mount's Prometheus endpoint
    # The server's uid, gid and groups, capabilities dropped (the keeper, root, mounts)
    server_user: Credentials | None = None
    # An open descriptor of the key file (`--key-fd`), inherited from the
    # caller: read at offset 0, never reopened by path (a server's key)
    key_fd: int | None = None
    # writes staged on the node and uploaded whole on close (else read-only)
    writable: bool = False
    staging_dir: str | None = None  # None: $BLOCKCACHE_STAGING_DIR, else /var/tmp
    staging_bytes: int = DEFAULT_STAGING_BYTES
    # "owner": only the server's uid (and root) may write, as the modes say;
    # "all": files 0666 and dirs 0777, any uid that reaches the mount (a pod's own)
    write_access: str = "owner"

    @property
    def meta_ttl(self) -> float:
        return self.ttl.default

    def fuse_options(self) -> set[str]:
        """The mount options (`session.mount.mount` turns them into mount(2) flags and
        FUSE options, or hands them to fusermount3)."""
        opts = {"default_permissions", "noatime", f"fsname=blockcache:{self.volume}",
                "subtype=blockcache"}  # the mount table's type: mountpoint.FSTYPE
        if not self.writable:
            opts.add("ro")
        if self.allow_other:
            opts.add("allow_other")
        opts.update(self.options)
        return opts


# Every key a volume TOML file may hold: the daemon's and Volume's names.
_KEYS = {"volume", "source", "mountpoint", "key_file", "socket", "block_size", "meta_ttl",
         "allow_other", "readahead_blocks", "options", "dir_ttl", "storage_options",
         "memory_cache_bytes", "fill_queue_bytes", "meta_cache_entries", "threads",
         "metrics_addr", "server_user", "server_groups", "store_pages", "max_nodes",
         "writable", "staging_dir", "staging_bytes", "write_access"}
# Old spellings, still read (with a warning naming the new key).
_RENAMED = {"memory_cache": "memory_cache_bytes", "fill_queue": "fill_queue_bytes"}


def load_toml(path: str) -> dict[str, Any]:
    """Read a volume TOML file; ConfigError names the file and the problem."""
    return read_toml(path, _KEYS, _RENAMED)


def parse_dir_ttl_flag(text: str) -> tuple[str, float]:
    """`--dir-ttl PREFIX=SECONDS` -> (prefix, seconds)."""
    prefix, sep, seconds = text.rpartition("=")
    if not sep:
        raise ConfigError(f"--dir-ttl {text!r}: expected PREFIX=SECONDS, e.g. code/=0")
    return prefix, convert.duration(seconds, f"--dir-ttl {text!r}", allow_zero=True)


def split_options(values: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`-o a,b -o c` -> ("a", "b", "c"), with empty items dropped. A comma
    inside double quotes stays in its option, as mount(8) and the kernel read
    it: `context="system_u:object_r:t:s0:c1,c2"` is one option."""
    out = []
    for v in values:
        for item in _QUOTED_COMMA.split(str(v)):
            item = item.strip()
            if item:
                out.append(item)
    return tuple(out)


def _str(data: dict[str, Any], key: str, required: bool) -> str | None:
    v = data.get(key)
    if v is None:
        if required:
            flag = {"mountpoint": "MOUNTPOINT argument", "source": "SOURCE argument"}.get(
                key, f"--{key.replace('_', '-')}")
            raise ConfigError(f"{key} is not set: give the {flag} or `{key} = ...` in --config")
        return None
    return convert.string(v, key)


def _int(data: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    return convert.count(data.get(key, default), key, lo, hi)


def build_config(file_data: Mapping[str, Any] | None = None,
                 **flags: Any) -> MountConfig:
    """Merge TOML data and flags (a flag that is None was not given) and validate.

    `dir_ttl` flags are (prefix, seconds) pairs added over the file's table;
    `options` flags are added to the file's list.
    """
    data: dict[str, Any] = dict(file_data or {})
    dir_ttl = dict(data.pop("dir_ttl", {}) or {})
    if not isinstance(dir_ttl, dict):
        raise ConfigError("dir_ttl must be a table of \"prefix\" = seconds")
    options = data.pop("options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise ConfigError("options must be a list of strings, e.g. [\"allow_other\"]")
    storage = data.pop("storage_options", {})
    if not isinstance(storage, dict):
        raise ConfigError("storage_options must be a table")
    for pair in flags.pop("dir_ttl", None) or ():
        prefix, seconds = pair
        dir_ttl[prefix] = seconds
    options = list(split_options(options)) + list(split_options(flags.pop("options", None) or ()))
    key_fd = flags.pop("key_fd", None)
    if key_fd is not None:
        _check_key_fd(key_fd)
    for k, v in flags.items():
        if k not in _KEYS:
            raise ConfigError(f"unknown setting {k}")
        if v is not None:
            data[k] = v

    volume = _str(data, "volume", True)
    try:
        check_volume_name(volume)
    except InvalidKey as exc:
        raise ConfigError(str(exc)) from None
    block_size = convert.size(data.get("block_size", DEFAULT_BLOCK_SIZE), "block_size")
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ConfigError(f"block_size: {block_size} must be between 64K and 16M")
    allow_other = convert.boolean(data.get("allow_other", False), "allow_other")
    if "allow_other" in options:
        options.remove("allow_other")
        allow_other = True
    for o in options:
        if o.split("=", 1)[0] in _RESERVED_OPTIONS:
            raise ConfigError(f"mount option {o!r} is not allowed: a mount is read-only "
                              f"unless writable = true (--writable), and fsclient sets "
                              f"fsname/subtype itself")
    try:
        check_mount_options(options)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    mountpoint = _str(data, "mountpoint", True)
    return MountConfig(
        volume=volume,
        source=_str(data, "source", True),
        mountpoint=mountpoint,
        key_file=_key_file(data, key_fd),
        socket=_str(data, "socket", False),
        block_size=block_size,
        ttl=TtlPolicy.build(data.get("meta_ttl", DEFAULT_META_TTL), dir_ttl),
        allow_other=allow_other,
        readahead_blocks=_int(data, "readahead_blocks", 2, 0, 64),
        options=tuple(dict.fromkeys(options)),
        storage_options=MappingProxyType(dict(storage)),
        memory_cache_bytes=convert.size(data.get("memory_cache_bytes", 64 << 20),
                                        "memory_cache_bytes"),
        fill_queue_bytes=convert.size(data.get("fill_queue_bytes", 256 << 20),
                                      "fill_queue_bytes"),
        meta_cache_entries=_int(data, "meta_cache_entries", 200_000, 100, 100_000_000),
        threads=_int(data, "threads", 1, 1, 512),
        max_nodes=_int(data, "max_nodes", DEFAULT_MAX_NODES, 100, 10_000_000),
        store_pages=convert.boolean(data.get("store_pages", True), "store_pages"),
        metrics_addr=convert.address(data.get("metrics_addr"), "metrics_addr"),
        server_user=_server_user(data),
        key_fd=key_fd,
        writable=convert.boolean(data.get("writable", False), "writable"),
        staging_dir=_str(data, "staging_dir", False),
        staging_bytes=convert.size(data.get("staging_bytes", DEFAULT_STAGING_BYTES),
                                   "staging_bytes"),
        write_access=_write_access(data),
    )


def _write_access(data: dict[str, Any]) -> str:
    value = convert.string(data.get("write_access", "owner"), "write_access")
    if value not in WRITE_ACCESS:
        raise ConfigError(f"write_access {value!r} is not one of {', '.join(WRITE_ACCESS)}: "
                          f"\"owner\" (the server's uid writes) or \"all\" (any uid that "
                          f"reaches the mount)")
    return value


def _check_key_fd(key_fd: Any) -> None:
    try:
        os.fstat(key_fd)
    except (OSError, TypeError, ValueError):
        raise ConfigError(f"--key-fd {key_fd!r} is not an open descriptor; give the number "
                          f"of one the key file is open on, e.g. --key-fd 3 3<KEYFILE") from None


def _key_file(data: dict[str, Any], key_fd: int | None) -> str | None:
    path = _str(data, "key_file", key_fd is None)
    # absolute: the mount records it for `warmup --mount`, run from anywhere
    return os.path.abspath(path) if path is not None else None


def _server_user(data: dict[str, Any]) -> Credentials | None:
    user, groups = data.get("server_user"), data.get("server_groups") or ()
    if not isinstance(groups, list | tuple):
        raise ConfigError("server_groups must be a list of gids, e.g. [10001]")
    if user is None:
        if groups:
            raise ConfigError("server_groups needs server_user (UID:GID) too")
        return None
    try:
        return Credentials.parse(convert.string(user, "server_user"),
                                 tuple(convert.count(g, "server_groups", 0, 2**32 - 2)
                                       for g in groups))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
