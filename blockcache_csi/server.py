"""The gRPC server on the kubelet's unix socket, and the plugin's life: take
over the mounts a previous plugin left, serve (and say so in the ready file,
the pod's readiness), and on SIGTERM stop serving while every mount goes on
(its keeper is the keeper host's, not ours)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from .identity import Identity
from .mounts import Mounts
from .node import Node
from .proto import csi_pb2_grpc
from .registration import Registrar
from .sources import SourcePolicy

log = logging.getLogger(__name__)

WORKERS = 8  # the kubelet's calls at once (publishes of different targets run side by side)
GRACE = 5.0  # seconds a call in progress gets once SIGTERM arrives
POLL_INTERVAL = 1.0


class EndpointError(ValueError):
    """--endpoint is not a unix socket this plugin can listen on."""


def socket_path(endpoint: str) -> str:
    """The path of a `unix:///path` (or `unix:/path`, or a bare path) endpoint."""
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://"):]
    elif endpoint.startswith("unix:"):
        path = endpoint[len("unix:"):]
    elif "://" in endpoint:
        raise EndpointError(f"endpoint {endpoint!r}: only unix sockets are served; give "
                            f"unix:///csi/csi.sock")
    else:
        path = endpoint
    if not path.startswith("/"):
        raise EndpointError(f"endpoint {endpoint!r}: the socket path must be absolute, e.g. "
                            f"unix:///csi/csi.sock")
    return path


def _replaceable(path: str) -> bool:
    """Whether a socket is at `path` (a previous plugin's, or one another plugin
    still serves on during a surge update); EndpointError if another kind of
    file is, which is never replaced."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise EndpointError(f"{path} exists and is not a socket; remove it or choose "
                            f"another --endpoint")
    return True


def serve(endpoint: str, mounts: Mounts, node_id: str, ready_file: str | None = None,
          registrar: Registrar | None = None, sources: SourcePolicy | None = None) -> int:
    """Take over, then serve (and register with the kubelet through
    `registrar`) until SIGTERM/SIGINT; the exit code."""
    path = socket_path(endpoint)
    mounts.state.prepare()
    mounts.adopt()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _replaceable(path)
    # bound at a name of our own, then renamed over `path` at once (no moment
    # without a socket there); gRPC unlinks the name it bound when it stops,
    # which by then names nothing, so a successor's socket at `path` stays
    bound = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"  # pids repeat across pods
    if _replaceable(bound):
        os.unlink(bound)
    server = grpc.server(ThreadPoolExecutor(WORKERS, thread_name_prefix="csi"))
    csi_pb2_grpc.add_IdentityServicer_to_server(Identity(), server)
    node = Node(mounts, node_id, sources or SourcePolicy([]))
    csi_pb2_grpc.add_NodeServicer_to_server(node, server)
    if server.add_insecure_port(f"unix:{bound}") == 0:
        raise EndpointError(f"cannot listen on {path}")
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("%s: stopping; the mounts stay, kept by the keeper host",
                 signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    server.start()
    _replaceable(path)
    os.rename(bound, path)
    ours = os.stat(path)
    if ready_file:  # every mount is ours now: the old pod may go (a surge update)
        with open(ready_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    log.info("serving CSI on %s (node %s, state in %s)", path, node_id, mounts.state.path)
    try:
        if registrar is not None:  # only now: the kubelet may publish at once
            registrar.start()
        while not stop.wait(POLL_INTERVAL):
            if registrar is not None:
                registrar.poll()
    finally:  # a registration that cannot bind ends the plugin, as cleanly
        if registrar is not None:
            registrar.stop()
        server.stop(GRACE).wait()
        _remove_if_ours(path, ours)
        if ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ready_file)
    return 0


def _remove_if_ours(path: str, ours: os.stat_result) -> None:
    """Unlink the socket unless a newer plugin has put its own there (a surge
    update: the new pod listens before the old one stops)."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino):
            os.unlink(path)
        else:
            log.info("%s is another plugin's socket now; left as it is", path)
    except FileNotFoundError:
        pass
