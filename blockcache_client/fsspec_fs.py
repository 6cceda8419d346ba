"""`blockcached::` — an fsspec filesystem that reads a remote store through `Volume`.

Anything fsspec-aware (pandas, PyArrow, xarray, a PyTorch Dataset using
`fsspec.open`) gets the host's shared, encrypted block cache by prefixing its
URL:

    fsspec.open("blockcached::s3://bucket/train/0001.jpg",
                blockcached={"volume": "imagenet", "key_file": "/etc/blockcache/imagenet.key"},
                s3={"endpoint_url": ...})
    fsspec.filesystem("blockcached", volume="imagenet", key_file=...,
                      target_protocol="s3", target_options={...}, root="bucket/train")

The protocol is `blockcached`, not `blockcache`: fsspec's own block cache
(`CachingFileSystem`) is registered as `blockcache`, and replacing it would
break its users. Read-only: every write raises PermissionError (EROFS).

The volume's root (what block keys are relative to) is `root` if given; else
the top of the target: "/" for file systems with a '/' root, the bucket (the
first path component) for object stores. Keep it stable: the same file under
another root gets other keys, so it would be cached twice.
See docs/fsspec.md.
"""

from __future__ import annotations

import errno
import io
import logging

import fsspec
from fsspec.implementations.chained import ChainedFileSystem

from .reader.volume import Volume

log = logging.getLogger(__name__)

PROTOCOL = "blockcached"


def _read_only(what: str, path) -> PermissionError:
    return PermissionError(errno.EROFS, f"{PROTOCOL}:: is read-only; cannot {what} {path}")


class BlockcachedFileSystem(ChainedFileSystem):
    """Read-only fsspec filesystem over one `Volume` (see the module docstring)."""

    protocol = PROTOCOL
    root_marker = ""

    def __init__(self, volume: str, key_file: str, socket_path: str | None = None,
                 target_protocol: str | None = None, target_options: dict | None = None,
                 fs: fsspec.AbstractFileSystem | None = None, root: str | None = None,
                 fo: str | None = None, block_size: int = 4 << 20, meta_ttl: float = 60.0,
                 memory_cache_bytes: int = 64 << 20, fill_queue_bytes: int = 256 << 20,
                 daemon_uid: int | None = None, chunk_cache: bool = True, **kwargs):
        super().__init__(**kwargs)
        if fs is None:
            fs = fsspec.filesystem(target_protocol or "file", **(target_options or {}))
        self.target = fs
        if root is None:
            root = self._default_root(fs, fo)
        self.root = fs._strip_protocol(root).rstrip("/") if root not in ("", "/") else root
        self.volume = Volume(volume, self.root or "/", key_file, socket_path,
                             block_size=block_size, meta_ttl=meta_ttl,
                             memory_cache_bytes=memory_cache_bytes,
                             fill_queue_bytes=fill_queue_bytes, daemon_uid=daemon_uid,
                             chunk_cache=chunk_cache, fs=fs)

    @staticmethod
    def _default_root(fs, fo: str | None) -> str:
        path = fs._strip_protocol(fo or "")
        if fs.root_marker == "/" or path.startswith("/"):
            return "/"
        path = path.strip("/")
        if not path:
            raise ValueError(f"{PROTOCOL}:: over {fs.protocol} needs root= (e.g. the bucket) "
                             f"or a URL naming it")
        return path.split("/", 1)[0]

    @classmethod
    def _strip_protocol(cls, path):
        path = fsspec.utils.stringify_path(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        return path.rstrip("/") if path not in ("", "/") else path

    # -- paths -------------------------------------------------------------------

    def _rel(self, path) -> str:
        path = self.target._strip_protocol(self._strip_protocol(path)).rstrip("/")
        root = self.root.rstrip("/")
        if root in ("", "/"):
            return path.lstrip("/")
        if path == root:
            return ""
        if not path.startswith(root + "/"):
            raise FileNotFoundError(errno.ENOENT, f"{path} is outside the volume root {root} "
                                                  f"of {PROTOCOL}::{self.volume.name}")
        return path[len(root) + 1:]

    def _full(self, rel: str) -> str:
        root = self.root.rstrip("/")
        if not rel:
            return root or "/"
        return f"{root}/{rel}" if root else f"/{rel}" if self.root == "/" else rel

    def _entry(self, info) -> dict:
        return {"name": self._full(info.path), "size": info.size,
                "type": "directory" if info.is_dir else "file", "islink": info.is_link,
                "mtime": info.mtime_ns / 1e9, "version": info.version, "mode": info.mode}

    # -- reads -------------------------------------------------------------------

    def info(self, path, **kwargs):
        return self._entry(self.volume.stat(self._rel(path)))

    def ls(self, path, detail=True, **kwargs):
        entries = [self._entry(i) for i in self.volume.listdir(self._rel(path))]
        return entries if detail else [e["name"] for e in entries]

    def cat_file(self, path, start=None, end=None, **kwargs):
        rel = self._rel(path)
        info = self.volume.stat(rel)
        size = info.size
        start = 0 if start is None else (max(0, size + start) if start < 0 else start)
        end = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
        if end <= start:
            return b""
        return self.volume.read(rel, start, end - start, info)

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None,
              **kwargs):
        if mode != "rb":
            raise _read_only(f"open with mode {mode!r}", path)
        raw = self.volume.open(self._rel(path))
        # a buffer absorbs the many tiny reads parsers make; big reads bypass it
        return io.BufferedReader(raw, buffer_size=min(1 << 20, self.volume.block_size))

    def invalidate_cache(self, path=None):
        self.target.invalidate_cache(path)

    def stats(self) -> dict:
        """The volume's read counters (`Volume.stats()`)."""
        return self.volume.stats()

    # -- writes are refused --------------------------------------------------------

    def _rm(self, path):
        raise _read_only("remove", path)

    def rm(self, path, recursive=False, maxdepth=None):
        raise _read_only("remove", path)

    def mkdir(self, path, create_parents=True, **kwargs):
        raise _read_only("create", path)

    def makedirs(self, path, exist_ok=False):
        raise _read_only("create", path)

    def cp_file(self, path1, path2, **kwargs):
        raise _read_only("copy to", path2)

    def mv(self, path1, path2, *args, **kwargs):
        raise _read_only("move", path1)

    def pipe_file(self, path, value, **kwargs):
        raise _read_only("write", path)

    def put_file(self, lpath, rpath, **kwargs):
        raise _read_only("write", rpath)

    def touch(self, path, truncate=True, **kwargs):
        raise _read_only("touch", path)


fsspec.register_implementation(PROTOCOL, BlockcachedFileSystem, clobber=True)
