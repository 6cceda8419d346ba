"""The operator chooses each server's uid, never the pod: `--namespace-uid
NAMESPACE=UID[:GID]` by the namespace the kubelet names, `--pv-uid
VOLUME_HANDLE=UID[:GID]` by a static PV's volumeHandle. A pod of another
namespace that names the victim's volume gets the default uid, and cannot
read the victim's data; a restarted plugin takes a mount over as the same
uid. Bad entries, and the retired `--volume-uid`, are refused at start."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from tests.support.csi_plugin import kubelet_keys
from tests.support.fsclient_mounts import REPO
from tests.support.keepers import keeper_status
from tests.support.proc_files import status_of
from tests.support.trees import snapshot
from tests.support.uids import NOBODY

VICTIM = 40001  # uids no account has: the victims' servers alone
STATIC = 40002


def _start_error(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockcache_csi", "--endpoint",
                           "unix:///nonexistent/csi.sock", "--node-id", "n", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("flag, entry, says", [
    ("--namespace-uid", "victims", "is not NAME=UID or NAME=UID:GID"),
    ("--namespace-uid", "victims=0", "never runs as root"),
    ("--namespace-uid", "Bad_Name=20001", "not a namespace name"),
    ("--namespace-uid", f"victims={NOBODY.pw_uid}", "give victims a uid of its own"),
    ("--pv-uid", "pv-1=0:5", "never runs as root"),
])
def test_a_bad_uid_entry_is_refused_at_start(flag, entry, says):
    out = _start_error(flag, entry)
    assert out.returncode == 2, out.stderr
    assert flag in out.stderr and says in out.stderr, out.stderr


def test_two_uids_for_one_namespace_are_refused():
    out = _start_error("--namespace-uid", "a=20001", "--namespace-uid", "a=20002")
    assert out.returncode == 2 and "two uids" in out.stderr, out.stderr


def test_the_retired_volume_uid_names_its_successors():
    out = _start_error("--volume-uid", "victim=20001")
    assert out.returncode == 2, out.stderr
    assert "--namespace-uid" in out.stderr and "--pv-uid" in out.stderr, out.stderr


def _uids(target: str) -> list[str]:
    return status_of(keeper_status(target)["server"])["Uid"].split()


@pytest.mark.fuse
@pytest.mark.timeout(180)
def test_a_pod_cannot_choose_another_namespaces_uid(world, keepers):
    # the victim's data: readable by its uid alone; every namespace may name it
    # as a source (the operator relies on uids here, not on the source policy)
    private = os.path.join(world.base, "victim-data")
    subprocess.run(["cp", "-a", world.source, private], check=True, timeout=60)
    subprocess.run(["chown", "-R", f"{VICTIM}:{VICTIM}", private], check=True, timeout=60)
    os.chmod(private, 0o700)
    args = ("--namespace-uid", f"victim={VICTIM}", "--pv-uid", f"pv-victim={STATIC}",
            "--allow-source", private)
    plugin = world.plugin(state="state-uids", name="uids", args=args).start()
    successor = None
    own, forged, static = world.target(), world.target(), world.target()
    try:
        victim = dict(world.context("victim", namespace="victim"), source=private)
        plugin.publish("vol-own", own, victim, world.key)
        assert snapshot(own) == snapshot(world.source)
        assert _uids(own) == [str(VICTIM)] * 4

        # a pod of namespace mallory names the victim's volume (and, inline, a
        # volume_id equal to the victim's PV handle): its server runs as nobody
        mallory = world.context("victim", namespace="mallory")
        plugin.publish("pv-victim", forged, mallory, world.key)
        assert _uids(forged) == [str(NOBODY.pw_uid)] * 4
        plugin.unpublish("pv-victim", forged)
        # ... and the victim's data is shut to it: the mount lists and reads nothing
        plugin.publish("vol-steal", forged, dict(mallory, source=private), world.key)
        assert _uids(forged) == [str(NOBODY.pw_uid)] * 4
        for attempt in (lambda: os.listdir(forged),
                        lambda: open(os.path.join(forged, "big.bin"), "rb").read(1)):
            with pytest.raises(PermissionError):
                attempt()
        plugin.unpublish("vol-steal", forged)

        # the operator's static PV, by its handle: its own uid
        pv = dict(mallory, **kubelet_keys("mallory", ephemeral=False))
        plugin.publish("pv-victim", static, pv, world.key)
        assert _uids(static) == [str(STATIC)] * 4

        # each key file is root's alone: neither server's uid opens any
        keys = os.path.join(world.base, "state-uids", "keys")
        assert (os.stat(keys).st_uid, stat.S_IMODE(os.stat(keys).st_mode)) == (0, 0o700)
        for name in os.listdir(keys):
            st = os.stat(os.path.join(keys, name))
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600), name
            for reader in (NOBODY.pw_uid, VICTIM, STATIC):
                cat = subprocess.run(["cat", os.path.join(keys, name)], user=reader,
                                     group=reader, extra_groups=[], capture_output=True,
                                     timeout=30)
                assert cat.returncode != 0, f"uid {reader} read {name}"

        # a restarted plugin (an upgrade) keeps the mounts: the same keepers and uids
        before = keeper_status(own)
        plugin.stop()
        successor = world.plugin(state="state-uids", name="uids2", args=args).start()
        assert keeper_status(own)["keeper"] == before["keeper"]
        assert _uids(own)[0] == str(VICTIM) and _uids(static)[0] == str(STATIC)
        assert snapshot(own) == snapshot(world.source)
        successor.unpublish("vol-own", own)
        successor.unpublish("pv-victim", static)
    finally:
        for p in (successor, plugin):
            if p is not None:
                p.stop()
        print(plugin.log(), successor.log() if successor else "")  # shown on failure
