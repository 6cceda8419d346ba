"""Readers that are not root (a training pod's uid) get their cache hits.

The reader opens block files the daemon owns; an open flag that only the
owner may use (O_NOATIME) once turned every such hit into a silent miss.
Children really drop to uid `nobody`, with the socket's group and a key file
they own, as a pod running as uid 1000 would.
"""

from __future__ import annotations

import os
import pwd
import shutil
import time

import fsspec

from blockcache_client import Volume
from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess
from tests.support.figures import record
from tests.support.remote_files import write_dataset
from tests.support.skips import needs_root
from tests.support.uids import as_nobody
from tests.support.volumes import BS, connected_volume, fill_files

pytestmark = needs_root


def _volume_reads(name: str, src: str, key: str, sock: str, files: dict[str, bytes]) -> dict:
    """Read every file once through a `Volume` (memory LRU off); its counters."""
    with Volume(name, src, key, socket_path=sock, block_size=BS, memory_cache_bytes=0) as vol:
        deadline = time.monotonic() + 10
        while not vol.stats()["daemon_connected"]:
            assert time.monotonic() < deadline, "never connected to the daemon"
            time.sleep(0.02)
        for rel, data in files.items():
            assert vol.read(rel, 0, len(data)) == data, rel
        return vol.stats()


def _fsspec_reads(name: str, src: str, key: str, sock: str, files: dict[str, bytes]) -> dict:
    """The same through `blockcached::` (fsspec), one whole-file `cat` each."""
    fs = fsspec.filesystem("blockcached", volume=name, key_file=key, socket_path=sock,
                           root=src, block_size=BS, memory_cache_bytes=0,
                           skip_instance_cache=True)
    try:
        deadline = time.monotonic() + 10
        while not fs.stats()["daemon_connected"]:
            assert time.monotonic() < deadline, "never connected to the daemon"
            time.sleep(0.02)
        for rel, data in files.items():
            assert fs.cat(f"{src}/{rel}") == data, rel
        return fs.stats()
    finally:
        fs.volume.close()


def test_non_root_volume_and_fsspec_readers_get_hits(tmp_path, shared_dir):
    nobody = pwd.getpwnam("nobody")
    src = os.path.join(shared_dir, "src")
    files = write_dataset(src, [BS // 2, BS + 7, 3 * BS], seed=23)
    blocks = sum(-(-len(d) // BS) for d in files.values())
    root_key, key = os.path.join(shared_dir, "root.key"), os.path.join(shared_dir, "vol.key")
    generate_key_file(root_key)
    shutil.copy(root_key, key)
    os.chown(key, nobody.pw_uid, nobody.pw_gid)  # 0400: the pod's own copy of the key
    d = DaemonProcess(tmp_path, cache_dirs=[(os.path.join(shared_dir, "cache"), "64M")],
                      extra_args=["--socket-group", str(nobody.pw_gid)])
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    d.start()
    try:
        # root warms the cache; the blocks are the daemon's (root's) files
        with connected_volume("vol", src, root_key, d) as vol:
            fill_files(vol, d, files)
        assert d.client().stats()["entries"] == blocks
        got = {"volume": as_nobody(_volume_reads, "vol", src, key, d.socket_path, files,
                                   gid=nobody.pw_gid),
               "fsspec": as_nobody(_fsspec_reads, "vol", src, key, d.socket_path, files,
                                   gid=nobody.pw_gid)}
        for path, s in got.items():
            assert (s["hits"], s["misses"]) == (blocks, 0), (path, s)
            assert s["integrity_failures"] == 0
        record("non_root_readers", uid="nobody", blocks=blocks,
               volume_hits=got["volume"]["hits"], volume_misses=got["volume"]["misses"],
               fsspec_hits=got["fsspec"]["hits"], fsspec_misses=got["fsspec"]["misses"])
    finally:
        d.stop()
