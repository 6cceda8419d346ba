"""The keeper's control socket: named so that any mount point fits (a
kubelet's are 130+ bytes), and trusted both ways. The keeper answers only
root and its own uid; the asker acts only on a keeper that is root or its
own uid (and the pid it expects). A squatter on a mount point's control
name, another uid, is refused by `fsclient status`, `restart`, `mount` and
`control.surrender`, is asked nothing, and the pid it names is not signalled."""

from __future__ import annotations

import json
import os
import socket
import uuid

import pytest

from fsclient import keeper as keeping
from fsclient.keeper import control, handoff
from tests.support.fsclient_mounts import fsclient, is_mounted
from tests.support.keepers import serving
from tests.support.squatter import squatting
from tests.support.uids import as_uid

pytestmark = pytest.mark.fuse

INTRUDER = 12345
WAIT = 60.0


def _kubelet_target(tmp_path) -> str:
    """A mount point shaped as a kubelet's CSI target, at least 150 bytes."""
    path = str(tmp_path / "var/lib/kubelet/pods" / str(uuid.uuid4()) /
               "volumes/kubernetes.io~csi" / f"pvc-{uuid.uuid4()}" / "mount")
    assert len(os.fsencode(path)) >= 150, path
    return path


def test_a_mount_point_of_150_bytes_mounts_reads_restarts_and_unmounts(tree, daemon, mounts,
                                                                     tmp_path):
    target = _kubelet_target(tmp_path)
    m = mounts(tree, daemon.socket_path, name=os.path.relpath(target, tmp_path))
    assert m.mountpoint == target and is_mounted(target)
    want = (tree / "big.bin").read_bytes()
    assert open(os.path.join(target, "big.bin"), "rb").read() == want
    res = fsclient("status", "--json", target)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["keeper"] == m.proc.pid
    before = serving(target)
    res = fsclient("restart", target)
    assert res.returncode == 0, res.stderr
    assert serving(target) != before
    assert open(os.path.join(target, "dir0/sub0/file0.bin"), "rb").read() == \
        (tree / "dir0/sub0/file0.bin").read_bytes()
    res = fsclient("umount", target)
    assert res.returncode == 0, res.stderr
    assert not is_mounted(target)
    assert m.proc.wait(30) == 0


def _ask_raw(mountpoint: str, op: str) -> tuple[dict | None, int]:
    """Ask the control socket `op` as the plain protocol would: (answer, how
    many descriptors came with it); the descriptors are closed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(control.control_address(mountpoint))
        handoff.send(sock, {"op": op})
        message, fds = handoff.receive(sock)
    for fd in fds:
        os.close(fd)
    return message, len(fds)


def test_another_uid_gets_nothing_from_a_keeper(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    server = serving(m.mountpoint)
    for op in ("surrender", "status", "restart"):
        answer, fds = as_uid(INTRUDER, INTRUDER, _ask_raw, m.mountpoint, op)
        assert fds == 0, (op, answer)
        assert answer == {"error": f"uid {INTRUDER} may not ask this keeper"}, (op, answer)
    assert "a control request from a uid other than root" in m.log()
    assert f"uid {INTRUDER}" in m.log()
    # nothing changed hands: the same keeper and server serve, asked by root
    status = keeping.status(m.mountpoint, expect_pid=m.proc.pid)
    assert status["server"] == server and status["restarts"] == 0
    assert os.listdir(m.mountpoint)


def _send_raw(mountpoint: str, data: bytes) -> dict | None:
    """Write `data` to the control socket as it comes; the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(control.control_address(mountpoint))
        sock.send(data)
        message, fds = handoff.receive(sock)
    for fd in fds:
        os.close(fd)
    return message


def test_bytes_that_are_no_request_end_no_keeper(tree, daemon, mounts):
    """Any uid may connect to a keeper's control name and write before it is
    checked: what is not a request (not JSON, not an object) is answered,
    and the same keeper and server serve on."""
    m = mounts(tree, daemon.socket_path)
    server = serving(m.mountpoint)
    for data in (b"\xff\x00 not json", b"[1, 2]", b'"surrender"'):
        answer = as_uid(INTRUDER, INTRUDER, _send_raw, m.mountpoint, data)
        assert answer == {"error": f"uid {INTRUDER} may not ask this keeper"}, (data, answer)
        assert _send_raw(m.mountpoint, data) == {"error": "unknown request None"}, data
    assert m.proc.poll() is None, m.log()
    status = keeping.status(m.mountpoint, expect_pid=m.proc.pid)
    assert status["server"] == server and status["restarts"] == 0
    assert os.listdir(m.mountpoint)


def test_a_keeper_not_of_the_expected_pid_is_an_impostor(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    with pytest.raises(keeping.Impostor) as exc:
        keeping.status(m.mountpoint, expect_pid=m.proc.pid + 100000)
    assert f"pid {m.proc.pid} uid 0" in str(exc.value)
    with pytest.raises(keeping.Impostor):
        keeping.surrender(m.mountpoint, 10, expect_pid=m.proc.pid + 100000)
    assert "surrendered" not in m.log()
    assert keeping.status(m.mountpoint, expect_pid=m.proc.pid)["keeper"] == m.proc.pid


def test_a_squatter_of_another_uid_is_refused_and_nothing_is_signalled(tree, key_file, daemon,
                                                                     tmp_path):
    mp = str(tmp_path / "mnt")
    os.makedirs(mp)
    with squatting(mp, INTRUDER) as squatter:
        holder = squatter.holder
        for args in (["status", mp], ["status", "--json", mp], ["restart", mp]):
            res = fsclient(*args)
            assert res.returncode == 1, (args, res.stdout)
            assert holder in res.stderr and "Traceback" not in res.stderr, (args, res.stderr)
        with pytest.raises(control.Impostor) as exc:
            control.surrender(mp, 10)
        assert holder in str(exc.value)
        with pytest.raises(keeping.Impostor):
            keeping.status(mp)
        res = fsclient("mount", str(tree), mp, "--volume", "testvol", "--key-file",
                       str(key_file), "--socket", daemon.socket_path)
        assert res.returncode == 1, res.stderr
        assert holder in res.stderr, res.stderr
        assert not is_mounted(mp)
        # connected to and checked, but asked nothing; nothing was signalled
        asked = squatter.asked()
        assert asked and set(asked) == {b"null"}, asked
        assert squatter.harmless()
