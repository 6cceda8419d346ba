"""The saved state follows what the kernel holds: a real mount under a keeper,
tens of thousands of lookups, then the kernel lets go of them (dropped
caches send their forgets); the record shrinks, and a node the kernel still
holds (an open file) is found by the server after the one before is killed."""

from __future__ import annotations

import os
import time

import pytest

from fsclient import keeper as keeping
from fsclient.keeper import saved
from tests.support.hostcaches import host_caches
from tests.support.keepers import kill_server, serving

pytestmark = pytest.mark.fuse

DIRS, PER_DIR = 16, 1500
# Once settled the log holds the live records, the header's page and dead
# records under COMPACT_MIN (those are left for a later compaction).
SETTLED = saved.COMPACT_MIN + 2 * saved.PAGE + 100 * 128


def _saved(mountpoint: str) -> dict:
    return keeping.recovered(mountpoint)


def test_forgotten_nodes_leave_the_saved_state_and_held_ones_survive(tmp_path, daemon,
                                                                      mounts, tmp_path_factory):
    root = tmp_path / "remote"
    names = []
    for d in range(DIRS):
        (root / f"class{d:03d}").mkdir(parents=True)
        for i in range(PER_DIR):
            name = f"class{d:03d}/train-image-{i:08d}-of-a-dataset.jpg"
            (root / name).write_bytes(b"")
            names.append(name)
    (root / "keep").mkdir()
    held_data = os.urandom(300_000)
    (root / "keep" / "held.bin").write_bytes(held_data)

    m = mounts(root, daemon.socket_path, args=["--meta-ttl", "60"])
    mnt = m.mountpoint
    # (its drops are host-wide, and another test's drop would forget its nodes early)
    with host_caches(tmp_path_factory), open(os.path.join(mnt, "keep", "held.bin"), "rb") as held:
        assert held.read(1000) == held_data[:1000]
        for name in names:
            os.stat(os.path.join(mnt, name))
        before = _saved(mnt)
        assert before["saved_nodes"] >= DIRS * PER_DIR, before

        # the kernel lets go of every node nothing pins; its forgets follow
        deadline = time.monotonic() + 60
        while True:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("2")
            now = _saved(mnt)
            if (now["saved_compactions"] >= 1 and now["saved_nodes"] < 100
                    and now["saved_bytes"] < SETTLED):
                break
            assert time.monotonic() < deadline, (before, now)
            time.sleep(0.5)
        assert before["saved_bytes"] > SETTLED + (256 << 10), before

        # the open file's node stayed: a new server reads it by the saved path
        old = kill_server(mnt)
        serving(mnt, other_than=old)
        held.seek(0)
        assert held.read() == held_data
    assert os.stat(os.path.join(mnt, names[123])).st_size == 0  # looked up afresh
    assert _saved(mnt)["saved_nodes"] >= 1
