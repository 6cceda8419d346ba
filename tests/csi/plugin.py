"""Helpers for the CSI plugin's tests: a Python the unprivileged server can
run, the plugin as a real process on a unix socket, a gRPC client, and a
cleanup that leaves no mount or process behind.

Everything the server (uid nobody) touches lives under one 0755 dir outside
pytest's 0700 tree: the daemon's socket and cache, the source, the state dir.
The targets sit under a 0750 root dir, as the kubelet's pod dirs do.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import grpc

from blockcache_csi.proto import csi_pb2, csi_pb2_grpc
from fsclient import keeper as keeping
from tests.support.waiting import wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOBODY = pwd.getpwnam("nobody")
START_TIMEOUT = 30.0
CALL_TIMEOUT = 60.0
Mode = csi_pb2.VolumeCapability.AccessMode.Mode


def socket_group() -> int:
    """A group that is neither root's nor nobody's, for blockcached's socket."""
    return next(g.gr_gid for g in grp.getgrall() if g.gr_gid not in (0, NOBODY.pw_gid))


def _nobody_can(paths: list[str]) -> bool:
    """Whether uid nobody may read (and search or run) every one of `paths`,
    asked of test(1) run as nobody (no fork of this threaded process)."""
    for p in paths:
        ok = subprocess.run(["test", "-r", p, "-a", "-x", p], user=NOBODY.pw_uid,
                            group=NOBODY.pw_gid, extra_groups=[], timeout=30,
                            capture_output=True)
        if ok.returncode != 0:
            return False
    return True


def server_python(base: str) -> tuple[str, dict[str, str]] | None:
    """(interpreter, environment) with which uid nobody can run this checkout:
    this one if nobody may run it (a container image), else the system's
    Python of the same version with this venv's packages on PYTHONPATH (a
    pyenv under /root is shut to other uids). A checkout nobody cannot reach
    (a clone under 0700 /root, as CI's) is seen through a read-only bind
    mount at `base`/repo, which `cleanup` removes. None if there is none."""
    repo, site = REPO, sysconfig.get_paths()["purelib"]
    here = os.path.realpath(sys.executable)
    stdlib = sysconfig.get_paths()["stdlib"]
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not _nobody_can([repo]) and site.startswith(REPO + "/"):
        repo = os.path.join(base, "repo")
        os.mkdir(repo)
        # read-only: nothing under `base` may ever delete the checkout
        for cmd in (["mount", "--bind", REPO, repo],
                    ["mount", "-o", "remount,bind,ro", repo]):
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        site = repo + site[len(REPO):]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, site]))
    env.pop("PYTHONHOME", None)
    if _nobody_can([here, stdlib, repo, site]):
        return sys.executable, env
    if os.path.exists(system) and _nobody_can([system, repo, site]):
        return system, env
    return None


def own_processes(marker: str) -> list[int]:
    """Pids whose command line holds `marker` (our unique tmp dir)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(name))
        except OSError:
            pass
    return out


def mounts_under(base: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split(" ")[4] for line in f]
    return [p for p in points if p.startswith(base + "/")]


FUSECTL = "/sys/fs/fuse/connections"


def _abort_connections(base: str) -> None:
    """Abort the FUSE connections mounted under `base`: a server's page-cache
    storer (`fsclient.session.storer`) may wait uninterruptibly for a read
    that no server will answer once everything is killed at once."""
    if not os.listdir(FUSECTL):
        subprocess.run(["mount", "-t", "fusectl", "none", FUSECTL], capture_output=True,
                       timeout=30)
    with open("/proc/self/mountinfo") as f:
        devices = [line.split(" ")[2] for line in f if line.split(" ")[4].startswith(base + "/")
                   and " - fuse" in line]
    for device in devices:
        with suppress(OSError):
            with open(os.path.join(FUSECTL, device.split(":")[1], "abort"), "w") as f:
                f.write("1")


def cleanup(base: str, spare: tuple[int, ...] = ()) -> None:
    """Abort and unmount every FUSE mount under `base`, and kill every process
    of ours there but `spare`."""
    with suppress(OSError):
        _abort_connections(base)
    for path in sorted(mounts_under(base), reverse=True):
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
    for pid in own_processes(base):
        if pid in spare:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kubelet_keys(namespace: str, ephemeral: bool = True) -> dict[str, str]:
    """The keys the kubelet adds to a volume_context (podInfoOnMount), over the pod's."""
    return {"csi.storage.k8s.io/pod.namespace": namespace,
            "csi.storage.k8s.io/pod.name": "pod", "csi.storage.k8s.io/pod.uid": "uid-1",
            "csi.storage.k8s.io/serviceAccount.name": "default",
            "csi.storage.k8s.io/ephemeral": "true" if ephemeral else "false"}


def environ_of(pid: int) -> dict[str, str]:
    """/proc/PID/environ as a dict."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.partition(b"=") for item in f.read().split(b"\0") if item]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def remove_keeper_cgroups(timeout: float = 10.0) -> None:
    """The keeper hosts' cgroups (`keeper-*`) beside ours in the v1 memory
    hierarchy, once the processes `cleanup` killed have left them (a host
    removes its own, but not when it is killed, nor those of keepers it left)."""
    with open("/proc/self/cgroup") as f:
        path = next((line.rstrip("\n").split(":", 2)[2] for line in f
                     if "memory" in line.split(":")[1].split(",")), None)
    if path is None:
        return
    base = "/sys/fs/cgroup/memory" + path
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for name in os.listdir(base) if os.path.isdir(base) else []:
            if name.startswith("keeper-"):
                try:
                    os.rmdir(os.path.join(base, name))
                except OSError:
                    left.append(name)
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def status_of(pid: int) -> dict[str, str]:
    """/proc/PID/status as a dict."""
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


def keeper_status(target: str) -> dict:
    return keeping.status(target)


def pids(target: str) -> tuple[int, int]:
    """(keeper, server) of the mount on `target`."""
    st = keeping.status(target)
    return st["keeper"], st["server"]


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


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if int(status_of(int(name))["PPid"]) == pid:
                    out.append(int(name))
            except (OSError, KeyError):
                pass
    return out


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
                secrets: dict[str, str] | None = None, **extra):
        secrets = dict(secrets or {}, **({} if key is None else {"key": key}))
        cap = extra.pop("volume_capability", csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(),
            access_mode=csi_pb2.VolumeCapability.AccessMode(mode=mode)))
        request = csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, target_path=target, volume_capability=cap, readonly=True,
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


def wait_new_server(target: str, other_than: int, timeout: float = 30.0) -> int:
    """The pid of a serving server of `target` other than `other_than`."""
    box: list[int] = []

    def serving() -> bool:
        try:
            st = keeping.status(target)
        except Exception:
            return False
        if st["serving"] and st["server"] != other_than:
            box.append(st["server"])
            return True
        return False

    wait_for(serving, timeout, f"a new server on {target}")
    return box[-1]


def dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"Z"
    except OSError:
        return True


def kill_mount(target: str) -> dict:
    """Kill `target`'s keeper and server together (stopped first, so neither
    starts the other again): the mount is dead (ENOTCONN). Their status."""
    st = keeping.status(target)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in (st["keeper"], st["server"]):
            os.kill(pid, sig)
    wait_dead(st["keeper"])
    try:
        os.listdir(target)
    except OSError as exc:
        assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED), exc
    else:
        raise AssertionError(f"{target} still answers after its keeper and server died")
    return st


def wait_dead(pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not dead(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} still runs after {timeout:g}s")
        time.sleep(0.05)


def keepers_under(host_pid: int) -> dict[str, int]:
    """{target: keeper pid} of the keepers whose parent is `host_pid` (pids as
    we see them: the host may be PID 1 of a namespace of its own)."""
    out = {}
    for pid in children_of(host_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "fsclient.cli" in argv and "mount" in argv and "--serve-fd" not in argv:
            out[argv[argv.index("mount") + 2]] = pid
    return out


class Busy:
    """A keeper busy with a restart (so it refuses to surrender) until `release`:
    `fsclient restart` of `target`, with the new server stopped (SIGSTOP)
    before it asks for the connection. `keeper`: its pid as we see it."""

    def __init__(self, target: str, keeper: int):
        self.target, self.keeper = target, keeper
        serving = set(children_of(keeper))  # (pids as we see them, whatever its namespace)
        self.result: list = []
        self.thread = threading.Thread(target=self._restart, daemon=True)
        self.thread.start()
        box: list[int] = []

        def new_server() -> bool:
            box[:] = [p for p in children_of(keeper) if p not in serving]
            return bool(box)

        wait_for(new_server, 10, f"the restart's server under keeper {keeper}")
        self.stopped = box[0]
        os.kill(self.stopped, signal.SIGSTOP)

    def _restart(self) -> None:
        try:
            self.result.append(keeping.restart(self.target, 60))
        except Exception as exc:  # reported by `release`
            self.result.append(exc)

    def refuses(self) -> bool:
        from fsclient.keeper import surrender

        try:
            surrender(self.target, 10).close()  # (never acked: it serves on)
        except ValueError:
            return True
        return False

    def release(self) -> dict:
        os.kill(self.stopped, signal.SIGCONT)
        self.thread.join(90)
        assert self.result and isinstance(self.result[0], dict), self.result
        return self.result[0]
