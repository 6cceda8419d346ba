"""The plugin's state dir and volume keys are root's alone (#41, "keys only
root can read"): the dir is forced to 0700 at every start, each key file is
0600 root, so neither uid 65534 (the default server uid, and node-exporter's)
nor a volume's own server uid can open one; a key left without a record (a
crash between the two writes) is removed at start.

`test_a_mount_serves_with_keys_only_root_can_read` needs fsclient's keeper
to open the key and hand its server a descriptor (another branch of #41):
until then a server opens its key file by path and cannot serve.
"""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from blockcache_csi.state import StateDir, target_id
from blockcache_csi.volumes import Publication
from tests.support.keepers import keeper_status
from tests.support.proc_files import status_of
from tests.support.trees import snapshot
from tests.support.uids import NOBODY

pytestmark = [pytest.mark.timeout(120)]
TENANT = 40002  # a --volume-uid: the volume's servers' own uid


def opens_as(uid: int, path: str) -> bool:
    """Whether `uid` (with no groups) can open `path` for reading."""
    out = subprocess.run(["cat", path], user=uid, group=uid, extra_groups=[],
                         capture_output=True, timeout=30)
    return out.returncode == 0


def owner_and_mode(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def assert_roots_alone(state: str, key_file: str) -> None:
    for d in (state, os.path.join(state, "mounts"), os.path.join(state, "keys")):
        assert owner_and_mode(d) == (0, 0, 0o700), d
    assert owner_and_mode(key_file) == (0, 0, 0o600)
    for uid in (NOBODY.pw_uid, TENANT):
        assert not opens_as(uid, key_file), f"uid {uid} read {key_file}"


def test_a_saved_key_is_roots_alone(tmp_path):
    state = StateDir(str(tmp_path / "state"))
    os.makedirs(os.path.join(state.path, "keys"), 0o711)  # as an older plugin left it
    os.chmod(state.path, 0o755)
    state.prepare()
    target = "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/v/mount"
    pub = Publication("v", target, (("source", "/data"), ("volume", "v")), (), True)
    key = bytes(range(32))
    state.save(pub, key)
    os.chmod(tmp_path, 0o755)  # only the state dir's own modes stand in the way
    assert_roots_alone(state.path, state.key_file(target))
    assert state.key(target) == key  # root reads it


@pytest.mark.fuse
def test_an_orphan_key_is_removed_at_start(world, keepers):
    state = os.path.join(world.base, "state-orphans")
    keys = os.path.join(state, "keys")
    os.makedirs(keys, 0o711)
    os.chmod(state, 0o755)
    orphan = os.path.join(keys, target_id("/gone/target") + ".key")
    leftover = os.path.join(keys, target_id("/other") + ".key.tmp")
    for path in (orphan, leftover):
        with open(path, "w") as f:
            f.write(world.key + "\n")
    plugin = world.plugin(state="state-orphans", name="orphans").start()
    try:
        assert os.listdir(keys) == []
        assert "no record names it" in plugin.log()
    finally:
        plugin.stop()


@pytest.mark.fuse
def test_a_mount_serves_with_keys_only_root_can_read(world, keepers):
    # the keeper (root) hands its server the key as a descriptor
    plugin = world.plugin(state="state-keys", name="keys",
                          args=("--namespace-uid", f"tenant-b={TENANT}")).start()
    target = world.target()
    try:
        plugin.publish("vol-key", target, world.context("data", namespace="tenant-b"),
                       world.key)
        assert snapshot(target) == snapshot(world.source)
        server = status_of(keeper_status(target)["server"])
        assert server["Uid"].split()[0] == str(TENANT)
        state = StateDir(plugin.state_dir)
        assert_roots_alone(state.path, state.key_file(target))
        plugin.unpublish("vol-key", target)
        assert os.listdir(state.keys) == []
    finally:
        plugin.stop()
        print(plugin.log())  # shown when the test failed
