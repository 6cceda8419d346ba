"""Fixtures for the reliability suite: a sample dataset, volume keys, real
daemons and mounts that are always stopped, and a child dropped to `nobody` or another uid."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import random
from collections.abc import Callable
from typing import Any

import pytest

from blockcache_client.contract import blockfile
from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess
from tests.support.uids import ChildError, as_uid  # noqa: F401  (ChildError re-exported)
from tests.support.waiting import wait_for as wait_until  # noqa: F401  (re-exported)

BS = 64 << 10  # the smallest block size fsclient accepts: many blocks from little data


def fuse_usable() -> bool:
    return os.geteuid() == 0 and os.path.exists("/dev/fuse")


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
needs_fuse = pytest.mark.skipif(not fuse_usable(), reason="needs root and /dev/fuse")


def write_dataset(root: str, sizes: list[int], seed: int = 1) -> dict[str, bytes]:
    """Files of the given sizes under `root`; returns {relative path: bytes}."""
    rng = random.Random(seed)
    files = {}
    for i, size in enumerate(sizes):
        rel = f"d{i % 3}/f{i:03d}.bin"
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = rng.randbytes(size)
        with open(path, "wb") as f:
            f.write(data)
        files[rel] = data
    return files


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def key_file(tmp_path) -> str:
    path = str(tmp_path / "volume.key")
    generate_key_file(path)
    return path


def socket_group() -> int:
    """A group nobody is not in: the daemon's socket group in tests whose
    children (other uids) join it as their gid."""
    nogroup = pwd.getpwnam("nobody").pw_gid
    return next(g.gr_gid for g in grp.getgrall() if g.gr_gid not in (0, nogroup))


def as_nobody(fn: Callable[..., Any], *args: Any, timeout: float = 30.0,
              gid: int | None = None) -> Any:
    """Run fn(*args) in a forked child that dropped to uid nobody, gid nobody's
    (or `gid`), no supplementary groups; return its result, or raise what it
    raised (ChildError)."""
    nobody = pwd.getpwnam("nobody")
    return as_uid(nobody.pw_uid, nobody.pw_gid if gid is None else gid, fn, *args,
                  timeout=timeout)


def peak_rss_kib(pid: int) -> int:
    """VmHWM (peak resident set) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for pid {pid}")


def cache_files(dirs: list[str]) -> dict[str, int]:
    """{path: size} of every regular file under the cache dirs' blocks/ and tmp/."""
    out = {}
    for d in dirs:
        for sub in ("blocks", "tmp"):
            for dirpath, _, names in os.walk(os.path.join(d, sub)):
                for n in names:
                    p = os.path.join(dirpath, n)
                    out[p] = os.lstat(p).st_size
    return out


def record(scenario: str, **figures: Any) -> None:
    """Append one scenario's figures to $RELIABILITY_FIGURES (JSON lines), if
    set; docs/reliability.md quotes them."""
    path = os.environ.get("RELIABILITY_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": scenario, **figures}) + "\n")


def check_index_matches_disk(daemon: DaemonProcess, volume_key: bytes) -> dict:
    """The daemon's index is exactly the complete, authentic blocks on disk."""
    s = daemon.wait_stats(lambda s: s["rebuild"]["state"] == "done" and s["queue"]["entries"] == 0
                          and all(d["queued_jobs"] == 0 for d in s["dirs"]), timeout=20)
    c = daemon.client()
    keys = c.list_all()
    paths = c.lookup(keys) if keys else []
    on_disk = cache_files(daemon.cache_dirs)
    tmp_dirs = tuple(os.path.join(d, "tmp") + os.sep for d in daemon.cache_dirs)
    tmp = [p for p in on_disk if p.startswith(tmp_dirs)]
    assert tmp == [], f"temp files left: {tmp}"
    assert all(p is not None for p in paths)
    assert sorted(paths) == sorted(on_disk), "index and blocks/ differ"
    assert not any(p.startswith(tmp_dirs) for p in paths), "a temp file is indexed"
    assert s["entries"] == len(on_disk) == len(keys)
    assert s["used_bytes"] == sum(on_disk.values())
    for d in s["dirs"]:
        mine = {p: n for p, n in on_disk.items() if p.startswith(d["path"] + os.sep)}
        assert d["entries"] == len(mine) and d["used_bytes"] == sum(mine.values()), d
        assert d["used_bytes"] <= d["limit_bytes"], d
    for key, path in zip(keys, paths):  # every indexed block is whole and authentic
        with open(path, "rb") as f:
            blockfile.unseal(key, f.read(), volume_key)
    return s


def connected_volume(name: str, source: str, key_file: str, daemon: DaemonProcess,
                     **kw: Any):
    """A `Volume` (memory LRU off: every read asks the cache disk or the
    source) that has reached the daemon."""
    from blockcache_client import Volume
    kw.setdefault("block_size", BS)
    kw.setdefault("memory_cache_bytes", 0)
    vol = Volume(name, source, key_file, socket_path=daemon.socket_path, **kw)
    try:
        wait_until(lambda: vol.stats()["daemon_connected"], what="the volume to connect")
    except BaseException:
        vol.close()
        raise
    return vol


def fill(vol, daemon: DaemonProcess, files: dict[str, bytes]):
    """Read every file once (checked) and wait until the fills are on disk;
    returns the daemon's layout."""
    from blockcache_client.contract.layout import Layout
    for rel, data in files.items():
        assert vol.read(rel, 0, len(data)) == data
    assert vol.wait_fills(10)
    daemon.wait_idle()
    return Layout.from_wire(daemon.client().hello()["layout"])


