"""A cold file loaded by mmap through a real mount (safetensors' `safe_open`:
the file mapped, each tensor copied out in order) is fetched by windows, as
a read() stream is: the kernel's faults read around themselves, so the
reader's run breaks and resumes inside the window it already fetched, and
must not start a new window over it (each resumption used to send requests
of one block each for the blocks the last window had not reached yet)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from blockcache_client.reader.options import part_blocks
from devtools.daemon import DaemonProcess
from tests.support.fsclient_mounts import FsclientMount, s3_config

pytestmark = pytest.mark.fuse

BS = 1 << 20
SIZE = 64 * BS + 4321
PART = part_blocks(BS)  # blocks a window's part brings: 8
# a loader: the file mapped, "tensors" of 3 MiB copied out in order
LOADER = """
import hashlib, mmap, sys
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
h = hashlib.sha256()
for off in range(0, len(m), 3 << 20):
    h.update(bytes(m[off:off + (3 << 20)]))
print(h.hexdigest())
"""


def test_a_mapped_cold_load_is_fetched_by_windows_not_block_by_block(tmp_path, s3, key_file):
    data = os.urandom(SIZE)
    s3.filesystem().pipe(f"{s3.bucket}/models/ckpt.bin", data)
    d = DaemonProcess(tmp_path).start()
    m = FsclientMount(s3.url("models"), str(tmp_path / "m"), str(key_file), d.socket_path,
                      args=["--block-size", str(BS), *s3_config(tmp_path / "s3.toml", s3)])
    try:
        m.start()
        got = subprocess.run([sys.executable, "-c", LOADER, os.path.join(m.mountpoint,
                                                                         "ckpt.bin")],
                             capture_output=True, text=True, timeout=120, check=True)
        assert got.stdout.strip() == hashlib.sha256(data).hexdigest()
        s = m.stats()
        assert s["backend_bytes"] == SIZE  # every block once
        blocks = -(-SIZE // BS)
        gets = s["backend_requests"] - s["version_checks"]
        # the cold open's block and the first reads before the run is seen
        # (a few blocks alone), then parts of PART blocks: 13 here; with each
        # resumption starting a window over the last one, 19
        assert gets <= blocks // PART + 7, (gets, s)
    finally:
        m.stop()
        d.stop()
