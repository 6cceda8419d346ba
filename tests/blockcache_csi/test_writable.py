"""A volume whose context says `writable: "true"`, published for a single-node
writer, is served read-write: a pod's uids write checkpoints through it, and
they are in the source once closed. Every other publication (a reader's mode,
readOnly, the `ro` flag, no `writable`) is read-only, and a bad value is
refused naming the field."""

from __future__ import annotations

import errno
import os

import grpc
import pytest

from tests.support.csi_plugin import Mode
from tests.support.uids import as_uid

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(120)]
SERVER_UID = 65534  # the plugin's default --server-uid: it writes the source
POD_UID = 1000      # a pod's own non-root user


@pytest.fixture(scope="module")
def source(world):
    """A source dir the servers (uid 65534) may write, under the allowed one."""
    path = os.path.join(world.source, "ckpts")
    os.makedirs(path)
    os.chown(path, SERVER_UID, SERVER_UID)
    return path


def publish(world, plugin, source, mode, readonly=False, **context):
    target = world.target()
    plugin.publish(f"vol-{os.path.basename(os.path.dirname(target))}", target,
                   world.context(source=source, **context), world.key, mode,
                   readonly=readonly)
    return target


def test_a_writable_volume_for_a_single_node_writer_is_read_write(world, plugin, source):
    target = publish(world, plugin, source, Mode.SINGLE_NODE_WRITER, writable="true")
    with open(os.path.join(target, "model.bin"), "wb") as f:
        f.write(b"weights" * 1000)
    assert open(os.path.join(source, "model.bin"), "rb").read() == b"weights" * 1000
    # any uid of the pod writes it (the mount is the pod's alone); the pod
    # reaches it at its mountPath, not through the kubelet's 0750 dirs: a
    # descriptor of the target stands in for that path
    top = os.open(target, os.O_PATH)
    try:
        def save() -> bytes:
            fd = os.open("by-pod.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644,
                         dir_fd=top)
            os.write(fd, b"saved by the pod's user")
            os.close(fd)
            os.mkdir("run-2", dir_fd=top)
            os.rename("by-pod.bin", "run-2/by-pod.bin", src_dir_fd=top, dst_dir_fd=top)
            return open(os.open("run-2/by-pod.bin", os.O_RDONLY, dir_fd=top), "rb").read()
        assert as_uid(POD_UID, POD_UID, save) == b"saved by the pod's user"
    finally:
        os.close(top)
    assert open(os.path.join(source, "run-2", "by-pod.bin"), "rb").read() == \
        b"saved by the pod's user"
    plugin.unpublish(f"vol-{os.path.basename(os.path.dirname(target))}", target)


@pytest.mark.parametrize("mode,readonly,context,flags", [
    (Mode.MULTI_NODE_READER_ONLY, False, {"writable": "true"}, ()),
    (Mode.MULTI_NODE_MULTI_WRITER, False, {"writable": "true"}, ()),
    (Mode.SINGLE_NODE_WRITER, True, {"writable": "true"}, ()),
    (Mode.SINGLE_NODE_WRITER, False, {"writable": "true"}, ("ro",)),
    (Mode.SINGLE_NODE_WRITER, False, {"writable": "false"}, ()),
    (Mode.SINGLE_NODE_WRITER, False, {}, ()),
], ids=["reader-mode", "multi-node-writer", "readOnly", "ro-flag", "writable-false",
        "not-asked"])
def test_every_other_publication_is_read_only(world, plugin, source, mode, readonly, context,
                                               flags):
    target = world.target()
    volume_id = f"vol-{os.path.basename(os.path.dirname(target))}"
    cap = None
    if flags:
        from blockcache_csi.proto import csi_pb2
        cap = csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(mount_flags=list(flags)),
            access_mode=csi_pb2.VolumeCapability.AccessMode(mode=mode))
    plugin.publish(volume_id, target, world.context(source=source, **context), world.key,
                   mode, readonly=readonly, **({"volume_capability": cap} if cap else {}))
    with pytest.raises(OSError) as err:
        open(os.path.join(target, "new.bin"), "wb")
    assert err.value.errno == errno.EROFS
    plugin.unpublish(volume_id, target)


def test_a_bad_writable_value_is_refused_by_name(world, plugin, source):
    with pytest.raises(grpc.RpcError) as err:
        publish(world, plugin, source, Mode.SINGLE_NODE_WRITER, writable="yes")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'volume_context["writable"]' in err.value.details()
