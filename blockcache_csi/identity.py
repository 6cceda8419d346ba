"""The CSI Identity service: who the plugin is, and that it is up."""

from __future__ import annotations

from typing import Any

from google.protobuf.wrappers_pb2 import BoolValue

from . import DRIVER_NAME, VERSION
from .proto import csi_pb2, csi_pb2_grpc


class Identity(csi_pb2_grpc.IdentityServicer):
    def GetPluginInfo(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC names)
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=VERSION)

    def GetPluginCapabilities(self, request: Any, context: Any) -> Any:  # noqa: N802
        # a node plugin alone: no controller service, no topology
        return csi_pb2.GetPluginCapabilitiesResponse()

    def Probe(self, request: Any, context: Any) -> Any:  # noqa: N802
        # serving means ready: a mount works without blockcached (reads go to
        # the source), so the daemon's state does not make the plugin unready
        return csi_pb2.ProbeResponse(ready=BoolValue(value=True))
