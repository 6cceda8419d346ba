"""The CSI Node service: each call checked, then handed to `Mounts`; every
refusal a gRPC status with a message naming the cause."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import grpc

from .errors import CsiError, required
from .mounts import Mounts
from .proto import csi_pb2, csi_pb2_grpc
from .sources import SourcePolicy
from .volumes import parse_publish

log = logging.getLogger(__name__)

RPC = csi_pb2.NodeServiceCapability.RPC
Unit = csi_pb2.VolumeUsage.Unit


def answered(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a `CsiError` into its status, anything else into INTERNAL naming it."""

    @functools.wraps(method)
    def call(self: Any, request: Any, context: Any) -> Any:
        try:
            return method(self, request, context)
        except CsiError as exc:
            log.warning("%s refused: %s", method.__name__, exc.message)
            context.abort(exc.code, exc.message)
        except Exception as exc:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed: "
                                                    f"{type(exc).__name__}: {exc}")

    return call


def usage_of(st: os.statvfs_result | None) -> list[Any]:
    """The usage entries of a statfs. Bytes always (the kubelet refuses an
    answer with no usage, and drops its condition with it): zeros when the
    mount gave nothing, which no capacity alert reads as full (0 of 0).
    Inodes only when known: blockcache's statfs counts the nodes its server
    holds and no free ones, which an inode alert would read as full."""
    if st is None:
        return [csi_pb2.VolumeUsage(unit=Unit.BYTES, total=0, available=0, used=0)]
    out = [csi_pb2.VolumeUsage(unit=Unit.BYTES, total=st.f_blocks * st.f_frsize,
                               available=st.f_bavail * st.f_frsize,
                               used=(st.f_blocks - st.f_bfree) * st.f_frsize)]
    if st.f_files > 0 and st.f_ffree > 0:
        out.append(csi_pb2.VolumeUsage(unit=Unit.INODES, total=st.f_files,
                                       available=st.f_favail, used=st.f_files - st.f_ffree))
    return out


class Node(csi_pb2_grpc.NodeServicer):
    def __init__(self, mounts: Mounts, node_id: str, sources: SourcePolicy):
        self.mounts = mounts
        self.node_id = node_id
        self.sources = sources  # the operator's --allow-source rules

    @answered
    def NodePublishVolume(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC names)
        pub, key, credentials = parse_publish(request, self.sources)
        log.info("publish volume %s at %s (namespace %s)", pub.volume_id, pub.target,
                 pub.namespace)
        self.mounts.publish(pub, key, credentials)
        return csi_pb2.NodePublishVolumeResponse()

    @answered
    def NodeUnpublishVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        required(request, "volume_id", "target_path")
        log.info("unpublish volume %s from %s", request.volume_id, request.target_path)
        self.mounts.unpublish(request.volume_id, request.target_path)
        return csi_pb2.NodeUnpublishVolumeResponse()

    @answered
    def NodeGetVolumeStats(self, request: Any, context: Any) -> Any:  # noqa: N802
        required(request, "volume_id", "volume_path")
        found = self.mounts.stats(request.volume_id, request.volume_path)
        if found.abnormal:
            log.warning("volume %s at %s: %s", request.volume_id, request.volume_path,
                        found.message)
        return csi_pb2.NodeGetVolumeStatsResponse(
            usage=usage_of(found.statvfs),
            volume_condition=csi_pb2.VolumeCondition(abnormal=found.abnormal,
                                                     message=found.message))

    def NodeGetCapabilities(self, request: Any, context: Any) -> Any:  # noqa: N802
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
            csi_pb2.NodeServiceCapability(rpc=RPC(type=kind))
            for kind in (RPC.GET_VOLUME_STATS, RPC.VOLUME_CONDITION)])

    def NodeGetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        # no volume limit and no topology: any node with the plugin serves any volume
        return csi_pb2.NodeGetInfoResponse(node_id=self.node_id)
