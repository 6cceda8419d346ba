"""What is on a daemon's cache disk, and a check that its index is exactly the
complete, authentic blocks there (after a crash, a full disk, a rebuild)."""

from __future__ import annotations

import os

from blockcache_client.contract import blockfile
from devtools.daemon import DaemonProcess


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
