"""blockcache-csi as the kubelet sees it: the real plugin process on a unix
socket, called by a real gRPC client, mounting through a real blockcached.

Publish makes a FUSE mount at the target with the source's bytes, served by
a non-root server with no capabilities; the Node cases csi-sanity checks
(idempotency, ALREADY_EXISTS, required fields, unpublish of what is not
mounted); a killed server fails no read; a restarted plugin keeps its mounts
(its new keepers take them over), and mounts again a target left without one.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from blockcache_csi import DRIVER_NAME, VERSION
from blockcache_csi.proto import csi_pb2
from tests.support.csi_plugin import Mode
from tests.support.fsclient_mounts import REPO
from tests.support.keepers import keeper_status, kill_mount, wait_new_server
from tests.support.proc_files import mounts_under, status_of, wait_dead
from tests.support.trees import snapshot
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(120)]
RPC = csi_pb2.NodeServiceCapability.RPC


def is_mount(path: str) -> bool:
    return path in mounts_under(os.path.dirname(path))


def fstype(path: str) -> str:
    for line in open("/proc/self/mountinfo"):
        fields = line.split(" ")
        if fields[4] == path:
            return fields[fields.index("-") + 1]
    return ""


def refused(call, code: grpc.StatusCode) -> str:
    """The message of `call`'s error, which must have `code`."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def test_help_names_every_option():
    out = subprocess.run([sys.executable, "-m", "blockcache_csi", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for option in ("--endpoint", "--node-id", "--state-dir", "--server-uid", "--server-gid",
                   "--namespace-uid", "--pv-uid", "--allow-source", "--s3-endpoint",
                   "--s3-region", "--allow-node-credentials", "--socket", "--ready-file",
                   "--keepers-socket",
                   "CSI_ENDPOINT", "NODE_ID"):
        assert option in out.stdout


def test_the_keeper_host_names_its_options_and_refuses_a_bad_size():
    run = [sys.executable, "-m", "blockcache_csi", "keepers"]
    out = subprocess.run([*run, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for option in ("--socket", "--server-memory", "--ready-file"):
        assert option in out.stdout
    bad = subprocess.run([*run, "--server-memory", "lots"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2
    assert "--server-memory" in bad.stderr and "512M" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_identity_and_node_info(plugin):
    info = plugin.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert (info.name, info.vendor_version) == (DRIVER_NAME, VERSION)
    caps = plugin.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
    assert list(caps.capabilities) == []  # no controller service
    assert plugin.identity.Probe(csi_pb2.ProbeRequest()).ready.value is True
    node_caps = plugin.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest())
    assert [c.rpc.type for c in node_caps.capabilities] == [RPC.GET_VOLUME_STATS,
                                                            RPC.VOLUME_CONDITION]
    assert plugin.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).node_id == "node-1"


def test_publish_serves_the_source_unprivileged_and_unpublish_removes_it(world, plugin):
    target = world.target()
    # a writer mode (what the kubelet asks for an inline volume) is served read-only
    plugin.publish("vol-a", target, world.context(), world.key, Mode.SINGLE_NODE_WRITER)
    assert fstype(target) == "fuse.blockcache"
    assert snapshot(target) == snapshot(world.source)
    with pytest.raises(OSError) as info:
        open(os.path.join(target, "new.txt"), "w")
    assert info.value.errno == errno.EROFS
    # the server: not root, no capability in any set, the daemon socket's group
    st = keeper_status(target)
    proc = status_of(st["server"])
    assert proc["Uid"].split() == ["65534"] * 4 and proc["Gid"].split() == ["65534"] * 4
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(proc[cap], 16) == 0, cap
    assert proc["NoNewPrivs"] == "1"
    assert proc["Groups"].split() == [str(world.socket_gid)]
    # its hits come from the daemon's cache, which it reached through the socket
    snapshot(target)
    stats = json.loads(os.getxattr(target, "user.blockcache.stats"))
    assert stats["daemon_connected"] is True

    # the kubelet repeats a publish: OK; another volume on the target: ALREADY_EXISTS
    plugin.publish("vol-a", target, world.context(), world.key)
    message = refused(lambda: plugin.publish("vol-b", target, world.context("other"),
                                             world.key), grpc.StatusCode.ALREADY_EXISTS)
    assert target in message and "vol-a" in message
    refused(lambda: plugin.publish("vol-a", target, world.context(metaTTL="5"), world.key),
            grpc.StatusCode.ALREADY_EXISTS)

    answer = plugin.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id="vol-a", volume_path=target))
    assert not answer.volume_condition.abnormal  # the hung and dead: test_volume_stats.py
    assert [u.unit for u in answer.usage] == [csi_pb2.VolumeUsage.BYTES]
    refused(lambda: plugin.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id="vol-x", volume_path=target)), grpc.StatusCode.NOT_FOUND)

    plugin.unpublish("vol-a", target)
    assert not is_mount(target) and not os.path.exists(target)
    wait_dead(st["server"])
    wait_dead(st["keeper"])
    plugin.unpublish("vol-a", target)  # again: OK, nothing to do


def test_bad_requests_are_refused_naming_the_cause(world, plugin):
    target = world.target()
    bad = grpc.StatusCode.INVALID_ARGUMENT
    assert "volume_id" in refused(lambda: plugin.publish("", target, world.context(),
                                                         world.key), bad)
    assert "target_path" in refused(lambda: plugin.publish("v", "", world.context(),
                                                           world.key), bad)
    no_cap = csi_pb2.NodePublishVolumeRequest(volume_id="v", target_path=target,
                                              volume_context=world.context(),
                                              secrets={"key": world.key})
    assert "volume_capability" in refused(lambda: plugin.node.NodePublishVolume(no_cap), bad)
    block = csi_pb2.VolumeCapability(
        block=csi_pb2.VolumeCapability.BlockVolume(),
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=Mode.MULTI_NODE_READER_ONLY))
    assert "block" in refused(lambda: plugin.publish("v", target, world.context(), world.key,
                                                     volume_capability=block), bad)
    assert "'colour'" in refused(lambda: plugin.publish(
        "v", target, world.context(colour="blue"), world.key), bad)
    # what the kubelet adds is accepted (checked by a publish below)
    ctx = world.context()
    del ctx["source"]
    assert "'source'" in refused(lambda: plugin.publish("v", target, ctx, world.key), bad)
    assert "blockSize" in refused(lambda: plugin.publish(
        "v", target, world.context(blockSize="huge"), world.key), bad)
    assert "dirTTL" in refused(lambda: plugin.publish(
        "v", target, world.context(dirTTL="code/"), world.key), bad)
    assert "volume name" in refused(lambda: plugin.publish(
        "v", target, world.context("Bad_Name"), world.key), bad)
    # the key: the Secret's field and the fix are named, its value never
    message = refused(lambda: plugin.publish("v", target, world.context(), None), bad)
    assert 'secrets["key"]' in message and "fsclient keygen" in message
    fake = "not-the-key-" + "z" * 40
    message = refused(lambda: plugin.publish("v", target, world.context(), fake), bad)
    assert 'secrets["key"]' in message and fake not in message and "z" * 10 not in message
    assert "pattern" in refused(lambda: plugin.publish("v", target, world.context(),
                                                       "ab" * 32), bad)
    assert not is_mount(target)

    for req, field in ((csi_pb2.NodeUnpublishVolumeRequest(target_path=target), "volume_id"),
                       (csi_pb2.NodeUnpublishVolumeRequest(volume_id="v"), "target_path")):
        assert field in refused(lambda r=req: plugin.node.NodeUnpublishVolume(r), bad)
    for req, field in ((csi_pb2.NodeGetVolumeStatsRequest(volume_path=target), "volume_id"),
                       (csi_pb2.NodeGetVolumeStatsRequest(volume_id="v"), "volume_path")):
        assert field in refused(lambda r=req: plugin.node.NodeGetVolumeStats(r), bad)
    refused(lambda: plugin.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id="v", volume_path=target)), grpc.StatusCode.NOT_FOUND)

    # unpublishing what was never published is OK, and removes the target dir
    os.makedirs(target)
    plugin.unpublish("v", target)
    assert not os.path.exists(target)

    # a publish with the kubelet's own keys and a source that does not exist
    kubelet = world.context(**{"csi.storage.k8s.io/pod.name": "p",
                               "csi.storage.k8s.io/ephemeral": "true"})
    kubelet["source"] = os.path.join(world.source, "missing")
    message = refused(lambda: plugin.publish("v", target, kubelet, world.key),
                      grpc.StatusCode.INTERNAL)
    assert "missing" in message and "does not exist" in message
    assert not is_mount(target)


def test_a_killed_server_or_keeper_fails_no_read(world, plugin, tmp_path):
    target = world.target()
    plugin.publish("vol-k", target, world.context("killed"), world.key)
    stop = str(tmp_path / "reader.stop")
    reader = subprocess.Popen([sys.executable, "-m", "devtools.mountreader", target,
                               world.source, stop, "--cwd", "dir0"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # kill only once the reader reads in the mount
        wait_for(lambda: os.readlink(f"/proc/{reader.pid}/cwd") == os.path.join(target, "dir0"),
                 30, "the reader to start")
        time.sleep(0.5)
        first = keeper_status(target)["server"]
        os.kill(first, signal.SIGKILL)
        second = wait_new_server(target, first)
        os.kill(second, signal.SIGKILL)
        third = wait_new_server(target, second)
        assert status_of(third)["Uid"].split()[0] == "65534"
        # the keeper killed: its server, unprivileged, starts the next keeper
        # (as itself) and hands over to that keeper's server
        keeper = keeper_status(target)["keeper"]
        os.kill(keeper, signal.SIGKILL)
        fourth = wait_new_server(target, third)
        replaced = keeper_status(target)
        assert replaced["keeper"] != keeper and replaced["server"] == fourth
        for pid in (replaced["keeper"], fourth):
            assert status_of(pid)["Uid"].split() == ["65534"] * 4
            assert status_of(pid)["NoNewPrivs"] == "1"
        time.sleep(0.5)
        open(stop, "w").close()
        out, err = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(10)
    assert reader.returncode == 0, err.decode()
    tally = json.loads(out)
    assert tally["ok"] > 0 and tally["failed"] == {} and tally["wrong"] == 0, tally
    plugin.unpublish("vol-k", target)
    assert not is_mount(target)
    wait_dead(replaced["keeper"])


def test_a_restarted_plugin_keeps_its_mounts_and_mounts_again_those_without_a_server(
        world, keepers):
    first = world.plugin(state="state-restart", name="restart").start()
    kept, orphan = world.target(), world.target()
    try:
        first.publish("vol-kept", kept, world.context("kept"), world.key)
        first.publish("vol-orphan", orphan, world.context("orphan", dirTTL="dir0/=0"),
                      world.key)
        before = keeper_status(kept)
        first.stop(signal.SIGKILL)  # a crash: nothing is handed over
        print(first.log())  # shown when the test failed
        assert snapshot(kept) == snapshot(world.source)  # served on meanwhile
        # the orphan's keeper and server die (as with an older plugin's
        # container, which held them): its mount is dead
        dying = kill_mount(orphan)

        second = world.plugin(state="state-restart", name="restart", by_env=True).start()
        try:
            after = keeper_status(kept)  # kept: the same keeper, the keeper host's
            assert after["keeper"] == before["keeper"] and after["server"] == before["server"]
            assert status_of(after["keeper"])["PPid"] == str(keepers.pid)
            assert snapshot(orphan) == snapshot(world.source)
            renewed = keeper_status(orphan)
            assert renewed["keeper"] != dying["keeper"]
            assert status_of(renewed["keeper"])["PPid"] == str(keepers.pid)
            assert status_of(renewed["server"])["Uid"].split()[0] == "65534"
            # the new plugin knows both: a repeated publish is OK, unpublish ends them
            second.publish("vol-kept", kept, world.context("kept"), world.key)
            for vid, target, st in (("vol-kept", kept, after), ("vol-orphan", orphan, renewed)):
                second.unpublish(vid, target)
                assert not is_mount(target)
                wait_dead(st["keeper"])
        finally:
            second.stop()
            print(second.log())
    finally:
        first.stop()
