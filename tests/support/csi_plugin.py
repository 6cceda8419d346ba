"""The CSI plugin and its keeper host as real processes on unix sockets, and a
gRPC client of the plugin, for the CSI plugin's tests (tests/blockcache_csi).

Everything the server (uid nobody) touches lives under one 0755 dir outside
pytest's 0700 tree: the daemon's socket and cache, the source, the state dir.
The targets sit under a 0750 root dir, as the kubelet's pod dirs do.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from blockcache_csi.proto import csi_pb2, csi_pb2_grpc
from tests.support.proc_files import children_of
from tests.support.waiting import wait_for

START_TIMEOUT = 30.0
CALL_TIMEOUT = 60.0
Mode = csi_pb2.VolumeCapability.AccessMode.Mode


def kubelet_keys(namespace: str, ephemeral: bool = True) -> dict[str, str]:
    """The keys the kubelet adds to a volume_context (podInfoOnMount), over the pod's."""
    return {"csi.storage.k8s.io/pod.namespace": namespace,
            "csi.storage.k8s.io/pod.name": "pod", "csi.storage.k8s.io/pod.uid": "uid-1",
            "csi.storage.k8s.io/serviceAccount.name": "default",
            "csi.storage.k8s.io/ephemeral": "true" if ephemeral else "false"}


def _tail(path: str) -> str:
    """The end of a log file ("" until the process has made it)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-6000:]
    except FileNotFoundError:
        return ""


def _start(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=env, cwd=cwd, start_new_session=True)


def _stop(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def running(process: Any) -> Iterator[Any]:
    """A started KeeperHost or Plugin, stopped at the end (its log printed:
    pytest shows it when a test failed)."""
    try:
        yield process
    finally:
        process.stop()
        print(process.log())


def pid_one(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """The pid, as we see it, of the PID 1 that `unshare --pid --fork` (`proc`)
    started in its new pid namespace."""
    box: list[int] = []
    wait_for(lambda: box.extend(children_of(proc.pid)) or bool(box), timeout,
             f"the child of unshare {proc.pid}")
    return box[0]


class KeeperHost:
    """`python -m blockcache_csi keepers` on a unix socket. `wrap`: a command
    it runs under (`unshare --pid --fork`: PID 1 of its own pid namespace)."""

    def __init__(self, python: str, env: dict[str, str], base: str, socket_path: str,
                 log_path: str, args: tuple[str, ...] = (), wrap: tuple[str, ...] = ()):
        self.python, self.env, self.base = python, env, base
        self.socket, self.log_path, self.args, self.wrap = socket_path, log_path, args, wrap
        self.proc: subprocess.Popen | None = None

    def start(self, ready_file: str | None = None, wait: bool = True) -> KeeperHost:
        argv = [*self.wrap, self.python, "-m", "blockcache_csi", "keepers", "--socket",
                self.socket, *self.args]
        if ready_file:
            argv += ["--ready-file", ready_file]
        self.proc = _start(argv, self.env, self.base, self.log_path)
        if wait:
            wait_for(lambda: self.answers(), START_TIMEOUT, "the keeper host's socket")
        return self

    def answers(self) -> bool:
        from blockcache_csi.keepers import KeeperHost as Client

        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the keeper host exited:\n{self.log()}")
        try:
            Client(self.socket).list()
            return True
        except Exception:
            return False

    @property
    def pid(self) -> int:
        """Its pid as we see it (PID 1 of its namespace, if wrapped by unshare)."""
        assert self.proc is not None
        return pid_one(self.proc) if self.wrap else self.proc.pid

    def log(self) -> str:
        return _tail(self.log_path)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        _stop(self.proc, sig)


class Plugin:
    """`python -m blockcache_csi` on a unix socket, and a client of it. `wrap`:
    a command it runs under (`unshare --pid --fork`, a cgroup's `sh -c`)."""

    def __init__(self, python: str, env: dict[str, str], base: str, state_dir: str,
                 daemon_socket: str, log_path: str, node_id: str = "node-1",
                 by_env: bool = False, name: str = "csi", args: tuple[str, ...] = (),
                 keepers: str = "", wrap: tuple[str, ...] = ()):
        self.python, self.env, self.base = python, env, base
        self.socket = os.path.join(base, name, "csi.sock")
        self.endpoint = f"unix://{self.socket}"
        self.state_dir, self.daemon_socket = state_dir, daemon_socket
        self.log_path, self.node_id, self.by_env = log_path, node_id, by_env
        self.args, self.keepers, self.wrap = args, keepers, wrap
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    def start(self) -> Plugin:
        argv = [*self.wrap, self.python, "-m", "blockcache_csi", "--state-dir",
                self.state_dir, "--socket", self.daemon_socket, *self.args]
        if self.keepers:
            argv += ["--keepers-socket", self.keepers]
        env = dict(self.env)
        if self.by_env:  # as the manifest passes them
            env.update(CSI_ENDPOINT=self.endpoint, NODE_ID=self.node_id)
        else:
            argv += ["--endpoint", self.endpoint, "--node-id", self.node_id]
        self.proc = _start(argv, env, self.base, self.log_path)
        self.channel = grpc.insecure_channel(self.endpoint)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=START_TIMEOUT)
        except grpc.FutureTimeoutError:
            raise RuntimeError(f"the plugin did not listen within {START_TIMEOUT:g}s:\n"
                               f"{self.log()}") from None
        return self

    def log(self) -> str:
        return _tail(self.log_path)

    @property
    def identity(self) -> csi_pb2_grpc.IdentityStub:
        return csi_pb2_grpc.IdentityStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        return csi_pb2_grpc.NodeStub(self.channel)

    def publish(self, volume_id: str, target: str, context: dict[str, str],
                key: str | None, mode: int = Mode.MULTI_NODE_READER_ONLY,
                secrets: dict[str, str] | None = None, readonly: bool = True, **extra):
        secrets = dict(secrets or {}, **({} if key is None else {"key": key}))
        cap = extra.pop("volume_capability", csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(),
            access_mode=csi_pb2.VolumeCapability.AccessMode(mode=mode)))
        request = csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, target_path=target, volume_capability=cap, readonly=readonly,
            volume_context=context, secrets=secrets, **extra)
        return self.node.NodePublishVolume(request, timeout=CALL_TIMEOUT)

    def unpublish(self, volume_id: str, target: str):
        return self.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target),
            timeout=CALL_TIMEOUT)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        _stop(self.proc, sig)
