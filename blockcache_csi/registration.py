"""The plugin registers itself with the kubelet (instead of a
node-driver-registrar sidecar): a socket of its own in the kubelet's
plugins_registry dir, serving the kubelet's `pluginregistration` API.

The socket's name is unique to this plugin instance, so no other plugin pod's
stop removes it; and when another instance's socket goes (the old pod of a
surge update stopping), this one binds a fresh socket, because older
kubelets deregister a CSI driver by its name whichever socket went
(DESIGN.md, "Registration with the kubelet")."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc

from . import DRIVER_NAME
from .proto import registration_pb2, registration_pb2_grpc

log = logging.getLogger(__name__)

PREFIX = f"{DRIVER_NAME}-"  # every instance's socket, and node-driver-registrar's
SUFFIX = ".sock"
CSI_VERSIONS = ["1.0.0"]
NAME_BYTES = len(f"{PREFIX}{'0' * 12}-{'0' * 8}{SUFFIX}")
MAX_PATH = 107  # bytes of a unix socket's path (sun_path, with its NUL)
GRACE = 1.0  # seconds a kubelet call in progress gets when the socket is replaced


class Registration(registration_pb2_grpc.RegistrationServicer):
    """What the kubelet's plugin watcher asks of a plugin's socket."""

    def __init__(self, endpoint: str, socket: str):
        self.endpoint, self.socket = endpoint, socket

    def GetInfo(self, request, context):
        return registration_pb2.PluginInfo(type="CSIPlugin", name=DRIVER_NAME,
                                           endpoint=self.endpoint,
                                           supported_versions=CSI_VERSIONS)

    def NotifyRegistrationStatus(self, request, context):
        if request.plugin_registered:
            log.info("the kubelet registered %s (CSI socket %s) through %s", DRIVER_NAME,
                     self.endpoint, self.socket)
        else:
            log.error("the kubelet refused to register %s through %s: %s; new volumes on "
                      "this node cannot be mounted until it registers", DRIVER_NAME,
                      self.socket, request.error or "no reason given")
        return registration_pb2.RegistrationStatusResponse()


def _siblings(directory: str, ours: str | None) -> dict[str, str]:
    """The other plugin instances' registration sockets in `directory`, by
    instance: `csi.blockcache.io-INSTANCE-N.sock` is instance INSTANCE's Nth
    (any other name, e.g. node-driver-registrar's `-reg.sock`, an instance
    of its own)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    out = {}
    for n in names:
        if n.startswith(PREFIX) and n.endswith(SUFFIX):
            middle = n[len(PREFIX):-len(SUFFIX)]
            instance = middle.rpartition("-")[0] or middle
            if instance != ours:
                out[instance] = n
    return out


def _dead(path: str) -> bool:
    """Whether no process listens on the socket at `path` any more (its
    plugin was killed, with no chance to remove it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:  # gone already, or not a socket: not ours to judge
            return False
    return False


class Registrar:
    """This plugin's registration socket in `directory` (the kubelet's
    plugins_registry), naming `endpoint` (the CSI socket's host path)."""

    def __init__(self, directory: str, endpoint: str):
        directory = os.path.abspath(directory)
        if len(os.fsencode(directory)) + 1 + NAME_BYTES > MAX_PATH:
            raise OSError(f"--registration-dir {directory}: too long for a unix socket's path "
                          f"(at most {MAX_PATH - 1 - NAME_BYTES} bytes); mount the kubelet's "
                          f"plugins_registry at a shorter path, e.g. /registration")
        self.directory, self.endpoint = directory, endpoint
        self.instance = secrets.token_hex(6)
        self.name: str | None = None
        self._server: grpc.Server | None = None
        self._seen: set[str] = set()  # the other instances
        self._gone: set[str] = set()  # those that went at the last poll

    @property
    def path(self) -> str | None:
        return None if self.name is None else os.path.join(self.directory, self.name)

    def start(self) -> None:
        """Remove the sockets of instances that were killed (the kubelet would
        call them in vain), then bind the first socket: the kubelet registers
        the driver."""
        for name in _siblings(self.directory, self.instance).values():
            path = os.path.join(self.directory, name)
            if _dead(path):
                log.info("removing %s: no plugin listens on it", path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._seen = set(_siblings(self.directory, self.instance))
        self._bind()

    def poll(self) -> None:
        """Called once a second: when another instance has left (no socket of
        it seen at two polls running), bind a fresh socket. One poll later, so
        that the kubelet has seen that removal (and deregistered the driver by
        name) before it sees the new socket; and only for an instance that has
        left, not one that registered again (removing its previous socket
        first), or two live plugins would answer each other's fresh socket
        with one of their own, forever."""
        now = set(_siblings(self.directory, self.instance))
        left = self._gone - now
        self._gone = self._seen - now
        self._seen = now
        if left:
            log.info("another %s plugin left the registration dir; registering again",
                     DRIVER_NAME)
            try:
                self._bind()
            except OSError as exc:  # the mounts and the CSI socket serve on; next poll
                log.error("cannot register again: %s", exc)
                self._gone |= left

    def stop(self) -> None:
        """Remove this instance's socket only (the kubelet deregisters it)."""
        self._unbind()

    def _bind(self) -> None:
        # the previous socket goes first: were it removed after the new one
        # was registered, an older kubelet would deregister the driver
        self._unbind()
        name = f"{PREFIX}{self.instance}-{secrets.token_hex(4)}{SUFFIX}"
        path = os.path.join(self.directory, name)
        server = grpc.server(ThreadPoolExecutor(2, thread_name_prefix="registration"))
        registration_pb2_grpc.add_RegistrationServicer_to_server(
            Registration(self.endpoint, path), server)
        try:
            bound = server.add_insecure_port(f"unix:{path}")
        except RuntimeError:  # newer grpcio raises where older ones returned 0
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {path} (--registration-dir)")
        server.start()
        self.name, self._server = name, server
        log.info("registration socket %s (CSI endpoint %s on the host)", path, self.endpoint)

    def _unbind(self) -> None:
        if self._server is not None:
            self._server.stop(GRACE).wait()
            self._server = None
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.name = None
