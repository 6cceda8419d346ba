"""Extended attributes: per-file cache state, and the volume's stats and
settings on the mount's root (`getfattr -n user.blockcache.stats /mnt`)."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from typing import Any

from blockcache_client import Volume
from blockcache_client.sources.fileinfo import FileInfo

from .config import MountConfig
from .inodes import ROOT_INODE
from .session import FuseError

XATTR_PREFIX = b"user.blockcache."
XATTR_CACHED = b"user.blockcache.cached_bytes"
XATTR_VERSION = b"user.blockcache.version"
XATTR_INODE = b"user.blockcache.inode"
XATTR_STATS = b"user.blockcache.stats"
# The mount's volume settings as JSON (volume TOML keys), for `fsclient warmup
# --mount`; storage_options (may hold credentials) only for root and the owner.
XATTR_CONFIG = b"user.blockcache.config"
ENOATTR = errno.ENODATA  # what Linux answers for an attribute a file does not have


class Xattrs:
    """The attributes of one mount's files."""

    def __init__(self, volume: Volume, cfg: MountConfig, owner_uid: int,
                 mount_stats: Callable[[], dict]):
        self.volume = volume
        self.cfg = cfg
        self._owner_uid = owner_uid
        self._mount_stats = mount_stats

    @staticmethod
    def names(inode: int, is_dir: bool) -> list[bytes]:
        names = [XATTR_INODE] if is_dir else [XATTR_CACHED, XATTR_VERSION, XATTR_INODE]
        if inode == ROOT_INODE:
            names += [XATTR_STATS, XATTR_CONFIG]
        return names

    def get(self, inode: int, info: FileInfo, name: bytes, caller_uid: int | None
                  ) -> bytes:
        """The value of `name` for `inode` (at `info`); ENOATTR if it has none.
        `caller_uid` None: asked from inside (no FUSE request context)."""
        if not name.startswith(XATTR_PREFIX) or name not in self.names(inode, info.is_dir):
            raise FuseError(ENOATTR)
        if name == XATTR_CACHED:
            return str(self.volume.cached_bytes(info.path, info=info)).encode()
        if name == XATTR_VERSION:
            return str(info.version).encode("utf-8", "surrogateescape")
        if name == XATTR_INODE:
            return str(inode).encode()
        if name == XATTR_CONFIG:
            return self._config_json(caller_uid is None or caller_uid in (0, self._owner_uid))
        stats = dict(self.volume.stats())
        stats["fsclient"] = self._mount_stats()
        return json.dumps(stats, sort_keys=True, default=str).encode()

    def _config_json(self, with_storage_options: bool) -> bytes:
        c = self.cfg
        out: dict[str, Any] = {"volume": c.volume, "source": c.source, "key_file": c.key_file,
                               "block_size": c.block_size, "fill_queue": c.fill_queue_bytes,
                               "memory_cache": c.memory_cache_bytes}
        if c.socket:
            out["socket"] = c.socket
        if with_storage_options:
            out["storage_options"] = dict(c.storage_options)
        elif c.storage_options:
            out["storage_options_hidden"] = True
        return json.dumps(out, sort_keys=True, default=str).encode()
