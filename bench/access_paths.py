"""How a worker process reads through one system: one `Reader` per kind of access path.

A reader is built inside the worker from a picklable spec (`make_reader`), so
every in-process cache lives in the process that uses it, as it would in a
DataLoader worker. Paths are relative to the bucket root (`imagenet/...`).

Each reader reads a whole file the way a user of that API would (`open` +
`read`), keeps open handles for ranged reads (an application holds its shards
open), and can stat. `stats()` returns the counters the system exposes, or {}.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import logging
import os
import sys
import time

log = logging.getLogger(__name__)

SEQ_CHUNK = 1 << 20
SETTLE_TIMEOUT = 60.0  # seconds a FUSE server's queued fills may take to leave it


class Reader:
    """The operations a workload needs; subclasses fill them for one access path."""

    def _open(self, path: str):
        """The file at `path`, opened for binary reading."""
        raise NotImplementedError

    def read_file(self, path: str) -> bytes:
        """Read a whole file."""
        with self._open(path) as f:
            return f.read()

    def read_seq(self, path: str, chunk: int = SEQ_CHUNK) -> int:
        """Read a file front to back in `chunk`-sized reads; returns bytes read."""
        n = 0
        with self._open(path) as f:
            while data := f.read(chunk):
                n += len(data)
        return n

    def read_seq_into(self, path: str, chunk: int = SEQ_CHUNK) -> int:
        """Read a file front to back with `readinto` into one buffer used for
        every read (a loader that owns its buffer); returns bytes read."""
        n = 0
        buf = bytearray(chunk)
        with self._open(path) as f:
            while got := f.readinto(buf):
                n += got
        return n

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        raise NotImplementedError

    def path_of(self, path: str) -> str:
        """A path the operating system opens `path` at (a mount, the local
        copy): what a loader that maps its file needs."""
        raise NotImplementedError(f"{type(self).__name__} reads no file by path")

    def stat(self, path: str) -> int:
        """The file's size (one metadata lookup)."""
        raise NotImplementedError

    def listdir(self, path: str) -> int:
        """List a directory (as ImageFolder scans its class dirs); returns the entry count."""
        raise NotImplementedError

    def import_finder(self, root: str):
        """A meta-path finder importing from `root`, or None when sys.path works."""
        return None

    def sys_path(self, root: str) -> str | None:
        """The directory to put on sys.path to import from `root`, if any."""
        return None

    def stats(self) -> dict:
        return {}

    def settle(self) -> None:
        """Finish background work of this process (fills) before the next epoch."""

    def close(self) -> None:
        pass


class PosixReader(Reader):
    """Plain file calls under a directory: a FUSE mount or the local copy."""

    def __init__(self, root: str, xattr_stats: str | None = None):
        self.root = root
        self.xattr_stats = xattr_stats
        self._fds: dict[str, int] = {}

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path)

    path_of = _p

    def _open(self, path: str):
        return open(self._p(path), "rb", buffering=0)

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(self._p(path), os.O_RDONLY)
        return os.pread(fd, size, offset)

    def stat(self, path: str) -> int:
        return os.stat(self._p(path)).st_size

    def listdir(self, path: str) -> int:
        with os.scandir(self._p(path)) as it:
            return sum(1 for e in it if e.is_file())

    def sys_path(self, root: str) -> str | None:
        return self._p(root)

    def stats(self) -> dict:
        if not self.xattr_stats:
            return {}
        try:
            return json.loads(os.getxattr(self.root, self.xattr_stats))
        except OSError as exc:
            log.warning("cannot read %s on %s: %s", self.xattr_stats, self.root, exc)
            return {}

    def settle(self) -> None:
        """Until the FUSE server's own fill queue is empty (its stats say how
        full it is): its fills must reach the daemon before the next epoch, as
        an in-process reader's do in `VolumeReader.settle`."""
        if not self.xattr_stats:
            return
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while self.stats().get("fill_queue_bytes") and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _FileAPIReader(Reader):
    """A reader over an object with `open(path)` returning a binary file (fsspec, Volume)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._files: dict[str, object] = {}

    def _p(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = self._open(path)
        f.seek(offset)
        return f.read(size)

    def import_finder(self, root: str):
        return FileAPIFinder(self, root)

    def isfile(self, path: str) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class FsspecReader(_FileAPIReader):
    """An fsspec filesystem: s3fs itself, or one of fsspec's caches chained over it."""

    def __init__(self, protocol: str, options: dict, prefix: str):
        import fsspec
        super().__init__(prefix)
        self.fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)

    def _open(self, path: str):
        return self.fs.open(self._p(path), "rb")

    def stat(self, path: str) -> int:
        return self.fs.info(self._p(path))["size"]

    def listdir(self, path: str) -> int:
        return len(self.fs.ls(self._p(path), detail=True))

    def isfile(self, path: str) -> bool:
        try:
            return self.fs.info(self._p(path))["type"] == "file"
        except FileNotFoundError:
            return False


class VolumeReader(_FileAPIReader):
    """This project's `Volume` (no FUSE)."""

    def __init__(self, args: dict):
        from blockcache_client import Volume
        super().__init__("")
        self.volume = Volume(**args)

    def _open(self, path: str):
        return self.volume.open(path)

    def stat(self, path: str) -> int:
        return self.volume.stat(path).size

    def listdir(self, path: str) -> int:
        return len(self.volume.listdir(path))

    def isfile(self, path: str) -> bool:
        try:
            return not self.volume.stat(path).is_dir
        except FileNotFoundError:
            return False

    def stats(self) -> dict:
        return self.volume.stats()

    def settle(self) -> None:
        self.volume.wait_fills(60.0)

    def close(self) -> None:
        super().close()
        self.volume.close()


class CrtFile:
    """One GET of a whole object through the CRT client, read as a file: the
    client's stream of parts (8 MiB, many in flight), each `read` cut from
    them as s3torchconnector's sequential reader does."""

    def __init__(self, stream):
        self._parts = iter(stream)
        self._buf = memoryview(b"")

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            rest = [self._buf.tobytes(), *self._parts]
            self._buf = memoryview(b"")
            return b"".join(rest)
        while not self._buf:
            part = next(self._parts, None)
            if part is None:
                return b""
            self._buf = memoryview(part)
        got, self._buf = self._buf[:size], self._buf[size:]
        return got.tobytes()

    def __enter__(self) -> CrtFile:
        return self

    def __exit__(self, *exc) -> None:
        self._parts = iter(())


class CrtReader(Reader):
    """AWS's CRT-based S3 client (s3torchconnectorclient's `MountpointS3Client`,
    what s3torchconnector and Mountpoint read with): no cache, every read a
    GET (whole objects in ranged parts fetched in parallel)."""

    def __init__(self, bucket: str, endpoint: str, region: str, key: str, secret: str):
        # the CRT takes credentials from the environment (its default chain)
        os.environ.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
        from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client
        self.bucket = bucket
        self.client = MountpointS3Client(region, endpoint=endpoint, force_path_style=True)

    def _open(self, path: str) -> CrtFile:
        return CrtFile(self.client.get_object(self.bucket, path))

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        return b"".join(self.client.get_object(self.bucket, path, offset, offset + size))

    def stat(self, path: str) -> int:
        return self.client.head_object(self.bucket, path).size

    def listdir(self, path: str) -> int:
        n = 0
        for page in self.client.list_objects(self.bucket, path.rstrip("/") + "/", "/"):
            n += len(page.object_info)
        return n


class FileAPIFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports modules stored under `root` through a reader's stat and read calls.

    What a Python user without a mount does to import code kept on remote
    storage; each module costs the lookups a path finder would make (package
    `__init__.py` first, then `name.py`) and one read.
    """

    def __init__(self, reader: _FileAPIReader, root: str):
        self.reader = reader
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        rel = f"{self.root}/{fullname.replace('.', '/')}"
        if self.reader.isfile(rel + "/__init__.py"):
            spec = importlib.util.spec_from_loader(fullname, self, is_package=True)
            spec.origin = rel + "/__init__.py"
            spec.submodule_search_locations = []
            return spec
        if self.reader.isfile(rel + ".py"):
            spec = importlib.util.spec_from_loader(fullname, self)
            spec.origin = rel + ".py"
            return spec
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        origin = module.__spec__.origin
        with self.reader._open(origin) as f:
            source = f.read()
        exec(compile(source, origin, "exec"), module.__dict__)


def make_reader(spec: dict) -> Reader:
    """Build the reader a spec describes (see `systems.System.reader_spec`)."""
    kind = spec["type"]
    if kind == "posix":
        return PosixReader(spec["root"], spec.get("xattr_stats"))
    if kind == "fsspec":
        return FsspecReader(spec["protocol"], spec["options"], spec["prefix"])
    if kind == "volume":
        return VolumeReader(spec["args"])
    if kind == "crt":
        return CrtReader(**spec["args"])
    raise ValueError(f"unknown reader type {kind!r}")


def import_all(reader: Reader, root: str, modules: list[str]) -> int:
    """Import every module of the tree under `root` from a clean slate; returns the count.

    The modules are dropped from sys.modules afterwards, so the next run
    imports them again (a fresh interpreter's view, minus its start-up).
    """
    finder = reader.import_finder(root)
    entry = None if finder else reader.sys_path(root)
    importlib.invalidate_caches()
    if finder:
        sys.meta_path.insert(0, finder)
    else:
        sys.path.insert(0, entry)
    try:
        for name in modules:
            importlib.import_module(name)
        return len(modules)
    finally:
        if finder:
            sys.meta_path.remove(finder)
        else:
            sys.path.remove(entry)
            # Path finders of the tree's directories cache their listings.
            for key in [k for k in sys.path_importer_cache if k.startswith(entry)]:
                del sys.path_importer_cache[key]
        top = modules[0].split(".")[0]
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]
