"""SELinux's `context=` mount option, as the kubelet passes it on an SELinux
node (`context="system_u:object_r:container_file_t:s0:c1,c2"`, one mount
flag, quoted for the commas of its level): a publish accepts it and checks
its shape, the label goes to the mount as one option where the node has
SELinux, and is left out where it has none (such a kernel refuses it).

This machine has no SELinux, so what a label does on a mount is not tested
here; what is: the plugin's acceptance and record, the option kept whole
from the publish to fsclient's mount(2) data, and that the kernel here
refuses it (so the plugin must not pass it on such a node).
"""

from __future__ import annotations

import errno
import json
import os

import grpc
import pytest

from blockcache_csi.environment import ServerEnvironment, SourceCredentials
from blockcache_csi.proto import csi_pb2
from blockcache_csi.volumes import mount_command, selinux_enabled
from fsclient.config import split_options
from fsclient.keeper import Credentials
from fsclient.session import mount as fusemount
from tests.support.csi_plugin import Mode
from tests.support.trees import snapshot

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(120)]
LABEL = "system_u:object_r:container_file_t:s0:c1,c2"
KUBELET_FLAG = f'context="{LABEL}"'  # pkg/volume/util: fmt.Sprintf("context=%q", label)


def capability(*flags: str):
    return csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(mount_flags=list(flags)),
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=Mode.MULTI_NODE_READER_ONLY))


def test_a_publish_with_the_kubelets_context_flag_is_accepted(world, plugin):
    assert not selinux_enabled(), "this test is written for a node without SELinux"
    target = world.target()
    plugin.publish("vol-se", target, world.context("selinux"), world.key,
                   volume_capability=capability("ro", KUBELET_FLAG))
    assert snapshot(target) == snapshot(world.source)
    # recorded as asked: a repeat is the same publish, another label is not
    records = os.path.join(plugin.state_dir, "mounts")
    found = [json.loads(open(os.path.join(records, n)).read()) for n in os.listdir(records)]
    (record,) = [r for r in found if r["target"] == target]
    assert record["mount_flags"] == ["ro", KUBELET_FLAG]
    plugin.publish("vol-se", target, world.context("selinux"), world.key,
                   volume_capability=capability("ro", f"context={LABEL}"))  # unquoted: same
    with pytest.raises(grpc.RpcError) as info:
        plugin.publish("vol-se", target, world.context("selinux"), world.key,
                       volume_capability=capability("ro", 'context="a_u:b_r:c_t:s0"'))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    # no SELinux here: the label was left out of the mount, and the log says so
    assert "not passed: SELinux is not enabled on this node" in plugin.log()
    plugin.unpublish("vol-se", target)


@pytest.mark.parametrize("flag", ['context="not a label"', "context=", "context=a:b",
                                  'context="a:b:c:s0:c1;rm"', "seclabel"])
def test_a_malformed_label_is_refused_naming_the_shape(world, plugin, flag):
    target = world.target()
    with pytest.raises(grpc.RpcError) as info:
        plugin.publish("vol-bad", target, world.context(), world.key,
                       volume_capability=capability(flag))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert repr(flag) in info.value.details() and "context=" in info.value.details()


def test_the_label_reaches_mount2_whole_where_the_node_has_selinux(tmp_path):
    from blockcache_csi.volumes import Publication

    pub = Publication("v", str(tmp_path / "mnt"), (("source", str(tmp_path)),
                                                     ("volume", "v")), ("ro", KUBELET_FLAG), True)
    server = Credentials(65534, 65534, ())
    argv, cfg, _ = mount_command(pub, str(tmp_path / "k.key"), None, server,
                                 SourceCredentials(), ServerEnvironment(), selinux=True)
    assert argv[argv.index("-o") + 1] == f"allow_other,ro,{KUBELET_FLAG}"
    assert split_options([f"allow_other,ro,{KUBELET_FLAG}"]) == ("allow_other", "ro",
                                                                KUBELET_FLAG)
    assert KUBELET_FLAG in cfg.fuse_options()  # what the keeper mounts with
    flags, kernel, _, _ = fusemount.split(sorted(cfg.fuse_options()))
    assert KUBELET_FLAG in kernel  # in mount(2)'s data, quotes and commas kept
    _, without, _ = mount_command(pub, str(tmp_path / "k.key"), None, server,
                                  SourceCredentials(), ServerEnvironment(), selinux=False)
    assert KUBELET_FLAG not in without.fuse_options()

    # this kernel (no SELinux) refuses the label: it did reach mount(2)
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    with pytest.raises(fusemount.MountFailed) as info:
        fusemount.mount(mnt, ["ro", "subtype=probe", KUBELET_FLAG])
    assert info.value.errno == errno.EINVAL and "SELinux" in str(info.value)
    fd = fusemount.mount(mnt, ["ro", "subtype=probe"])  # the same without it mounts
    fusemount.unmount_lazy(mnt)
    os.close(fd)
