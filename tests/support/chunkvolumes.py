"""Volumes of 1 MiB blocks read in 64 KiB chunks, for the chunk cache and
handle-hit tests: files cached by another reader first, evicted by the CLI,
or rewritten in place as the same version."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import volumes
from tests.support.waiting import wait_for

BS = 1 << 20        # 16 chunks of 64 KiB a block
CHUNK = 64 << 10


def volume(source, key_file, daemon, **kw):
    kw.setdefault("block_size", BS)
    return volumes.volume(source, key_file, daemon, **kw)


def settle(vol, daemon):
    volumes.settle(vol, daemon, timeout=20)


def filled(source, key_file, daemon, path, data):
    """`path` written with `data` and cached by another reader (whole-file
    reads keep no chunks), so the reader under test finds it on the disk."""
    source.write(path, data)
    with volume(source, key_file, daemon) as filler:
        wait_for(lambda: filler.stats()["daemon_connected"], what="the daemon")
        assert filler.read(path, 0, len(data)) == data
        settle(filler, daemon)


def cli_evict(daemon, vol, path):
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "blockcache-cli"),
                          "--socket", daemon.socket_path, "evict", "--inode", vol.name,
                          str(vol.inode(path))], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def same_version_rewrite(source, path, data):
    """Rewrite a local file with the same size and mtime: the same version
    (the documented limit), so only the block file tells old from new."""
    full = os.path.join(source.root, path)
    st_ = os.stat(full)
    with open(full, "r+b") as f:
        f.write(data)
    os.utime(full, ns=(st_.st_atime_ns, st_.st_mtime_ns))
