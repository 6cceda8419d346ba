"""The plugin registers itself with the kubelet: a socket with a name of its
own in the registration dir once it is ready, answering the kubelet's
pluginregistration calls (a real gRPC client plays the kubelet); a fresh
socket when another instance's socket goes; at SIGTERM only its own socket
removed."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from contextlib import closing

import grpc
import pytest

from blockcache_csi.proto import registration_pb2, registration_pb2_grpc
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(60)]

HOST_PATH = "/var/lib/kubelet/plugins/csi.blockcache.io/csi.sock"
OURS = re.compile(r"csi\.blockcache\.io-[0-9a-f]{12}-[0-9a-f]{8}\.sock")


def _own_sockets(regdir: str, others: set[str] = frozenset()) -> set[str]:
    return {n for n in os.listdir(regdir) if OURS.fullmatch(n) and n not in others}


def _one_socket(regdir: str, others: set[str] = frozenset()) -> str:
    box: list[str] = []

    def found() -> bool:
        names = _own_sockets(regdir, others)
        box[:] = sorted(names)
        return len(names) == 1

    wait_for(found, 15, f"one registration socket in {regdir}")
    return box[0]


def _kubelet(path: str) -> registration_pb2_grpc.RegistrationStub:
    channel = grpc.insecure_channel(f"unix:{path}")
    grpc.channel_ready_future(channel).result(timeout=10)
    return registration_pb2_grpc.RegistrationStub(channel)


def _sibling(regdir: str, name: str) -> socket.socket:
    """Another instance's registration socket, as a plain bound unix socket."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(os.path.join(regdir, name))
    s.listen()
    return s


def _registering(world, name: str, regdir: str):
    ready = os.path.join(world.base, f"{name}.ready")
    return world.plugin(state=f"state-{name}", name=name, args=(
        "--registration-dir", regdir, "--kubelet-registration-path", HOST_PATH,
        "--ready-file", ready)), ready


def test_the_kubelet_gets_the_plugins_info_through_a_socket_of_its_own(world, keepers):
    regdir = os.path.join(world.base, "registry-info")
    os.makedirs(regdir)
    # a killed plugin's socket: the file stays, nobody listens
    _sibling(regdir, "csi.blockcache.io-deaddeaddead.sock").close()
    plugin, ready = _registering(world, "reg-info", regdir)
    plugin.start()
    try:
        name = _one_socket(regdir, {"csi.blockcache.io-deaddeaddead.sock"})
        assert "csi.blockcache.io-deaddeaddead.sock" not in os.listdir(regdir)
        assert os.path.exists(ready)  # bound only once the plugin is ready
        kubelet = _kubelet(os.path.join(regdir, name))
        info = kubelet.GetInfo(registration_pb2.InfoRequest(), timeout=10)
        assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == \
            ("CSIPlugin", "csi.blockcache.io", HOST_PATH, ["1.0.0"])
        kubelet.NotifyRegistrationStatus(
            registration_pb2.RegistrationStatus(plugin_registered=True), timeout=10)
        kubelet.NotifyRegistrationStatus(registration_pb2.RegistrationStatus(
            plugin_registered=False, error="driver name clash xyzzy"), timeout=10)
        wait_for(lambda: "refused to register" in plugin.log(), 10, "the refusal logged")
        refusal = next(line for line in plugin.log().splitlines() if "refused" in line)
        assert "ERROR" in refusal and "driver name clash xyzzy" in refusal
        assert "the kubelet registered csi.blockcache.io" in plugin.log()
    finally:
        plugin.stop()
    assert _own_sockets(regdir) == set()


def test_a_sibling_going_makes_it_register_again_and_it_removes_only_its_own(world, keepers):
    regdir = os.path.join(world.base, "registry-sibling")
    os.makedirs(regdir)
    # node-driver-registrar's fixed name, and another plugin instance's
    with closing(_sibling(regdir, "csi.blockcache.io-reg.sock")), \
            closing(_sibling(regdir, "csi.blockcache.io-0123456789ab.sock")):
        first, _ = _registering(world, "reg-a", regdir)
        first.start()
        try:
            others = {"csi.blockcache.io-0123456789ab.sock"}
            name = _one_socket(regdir, others)
            os.unlink(os.path.join(regdir, "csi.blockcache.io-reg.sock"))
            wait_for(lambda: _own_sockets(regdir, others) - {name}, 10,
                     "a fresh registration socket")
            again = _one_socket(regdir, others)
            assert again != name and not os.path.exists(os.path.join(regdir, name))
            info = _kubelet(os.path.join(regdir, again)).GetInfo(
                registration_pb2.InfoRequest(), timeout=10)
            assert info.name == "csi.blockcache.io"

            # a second plugin instance: its own name; when a third leaves, both
            # register again, once (neither answers the other's fresh socket)
            third = _sibling(regdir, "csi.blockcache.io-fedcba987654.sock")
            second, _ = _registering(world, "reg-b", regdir)
            second.start()
            try:
                theirs = _one_socket(regdir, others | {again})
                time.sleep(1.5)  # both have seen the third
                third.close()
                os.unlink(os.path.join(regdir, "csi.blockcache.io-fedcba987654.sock"))
                wait_for(lambda: not ({again, theirs} & set(os.listdir(regdir)))
                         and len(_own_sockets(regdir)) == 2, 10, "both to register again")
                settled = _own_sockets(regdir)
                time.sleep(3)
                assert _own_sockets(regdir) == settled
                again = next(n for n in settled if n.startswith(again[:30]))
                theirs = next(n for n in settled if n != again)
            finally:
                second.stop()
            # when the second stops, the first registers again and the second
            # left the first's socket alone
            assert not os.path.exists(os.path.join(regdir, theirs))
            wait_for(lambda: not os.path.exists(os.path.join(regdir, again)), 10,
                     "the first plugin to register again")
            latest = _one_socket(regdir, others)
            assert latest not in (again, theirs)
        finally:
            first.stop()
        # at SIGTERM it removed its own socket only
        assert sorted(os.listdir(regdir)) == ["csi.blockcache.io-0123456789ab.sock"]


def test_a_registration_dir_too_long_for_a_socket_is_refused_at_start(world):
    regdir = os.path.join(world.base, "registry-" + "x" * 100)
    os.makedirs(regdir)
    plugin, ready = _registering(world, "reg-long", regdir)
    out = subprocess.run(
        [world.python, "-m", "blockcache_csi", "--endpoint", plugin.endpoint, "--node-id", "n",
         "--state-dir", plugin.state_dir, "--socket", plugin.daemon_socket,
         *plugin.args], env=world.env, cwd=world.base, capture_output=True, text=True,
        timeout=30)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"blockcache-csi: error: --registration-dir {regdir}: too long for a unix socket")
    assert not os.path.exists(ready) and os.listdir(regdir) == []
