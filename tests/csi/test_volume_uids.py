"""`--volume-uid VOLUME=UID[:GID]`: the servers of that blockcache volume run
as a uid of their own, apart from every other volume's (the shared
--server-uid), with a key file only they may read; a restarted plugin takes
them over as the same uid. Bad entries are refused at start, naming the fix."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from tests.csi.plugin import NOBODY, REPO, keeper_status, status_of
from tests.support.trees import snapshot

TENANT = 40001  # a uid no account has: the volume's servers alone


def _start_error(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockcache_csi", "--endpoint",
                           "unix:///nonexistent/csi.sock", "--node-id", "n", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("entry, says", [
    ("imagenet", "is not VOLUME=UID or VOLUME=UID:GID"),
    ("imagenet=0", "never runs as root"),
    ("Bad_Name=20001", "invalid volume name"),
    (f"imagenet={NOBODY.pw_uid}", "give volume imagenet a uid of its own"),
])
def test_a_bad_volume_uid_is_refused_at_start(entry, says):
    out = _start_error("--volume-uid", entry)
    assert out.returncode == 2, out.stderr
    assert "--volume-uid" in out.stderr and says in out.stderr, out.stderr


def test_two_uids_for_one_volume_are_refused():
    out = _start_error("--volume-uid", "imagenet=20001", "--volume-uid", "imagenet=20002")
    assert out.returncode == 2 and "two uids" in out.stderr, out.stderr


@pytest.mark.fuse
@pytest.mark.timeout(180)
def test_a_volume_uid_runs_that_volumes_servers_apart(world, keepers):
    args = ("--volume-uid", f"tenant-a={TENANT}")
    plugin = world.plugin(state="state-uids", name="uids", args=args).start()
    successor = None
    own, shared = world.target(), world.target()
    try:
        plugin.publish("vol-own", own, world.context("tenant-a"), world.key)
        plugin.publish("vol-shared", shared, world.context("data"), world.key)
        assert snapshot(own) == snapshot(world.source) == snapshot(shared)
        ids = {t: status_of(keeper_status(t)["server"]) for t in (own, shared)}
        assert ids[own]["Uid"].split() == [str(TENANT)] * 4
        assert ids[own]["Gid"].split() == [str(TENANT)] * 4
        assert ids[shared]["Uid"].split() == [str(NOBODY.pw_uid)] * 4

        # each key file is its own server's alone; the dir lists none
        keys = os.path.join(world.base, "state-uids", "keys")
        st = os.stat(keys)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o711)
        owners = {os.stat(os.path.join(keys, n)).st_uid: os.path.join(keys, n)
                  for n in os.listdir(keys)}
        assert set(owners) == {TENANT, NOBODY.pw_uid}
        for reader, other in ((NOBODY.pw_uid, owners[TENANT]),
                              (TENANT, owners[NOBODY.pw_uid])):
            cat = subprocess.run(["cat", other], user=reader, group=reader, extra_groups=[],
                                 capture_output=True, timeout=30)
            assert cat.returncode != 0, f"uid {reader} read {other}"

        # a restarted plugin (an upgrade) keeps the mount: the same keeper and uid
        before = keeper_status(own)
        plugin.stop()
        successor = world.plugin(state="state-uids", name="uids2", args=args).start()
        after = keeper_status(own)
        assert after["keeper"] == before["keeper"]
        assert status_of(after["server"])["Uid"].split()[0] == str(TENANT)
        assert snapshot(own) == snapshot(world.source)
        successor.unpublish("vol-own", own)
        successor.unpublish("vol-shared", shared)
    finally:
        for p in (successor, plugin):
            if p is not None:
                p.stop()
        print(plugin.log(), successor.log() if successor else "")  # shown on failure
