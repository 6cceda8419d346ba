"""Keys as descriptors, servers not dumpable. The key file is root's, 0600;
the server runs as uid 65534 (`--server-user`), which may not open it: the
keeper hands each server an open descriptor of the key, and a server whose
keeper dies passes it on to the keeper it starts (uid 65534 too), which
restarts a killed server with it. A process of the server's own uid can read
neither the server's memory nor its environment (PR_SET_DUMPABLE 0), nor
the next keeper's."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
import time

import pytest

from blockcache_client.volumekey import generate_key_file
from fsclient import keeper as keeping
from tests.fsclient.conftest import BLOCK, make_tree
from tests.support.fsclient_mounts import FsclientMount, fsclient
from tests.support.leftovers import cleanup
from tests.support.nobody_python import server_python
from tests.support.proc_files import own_processes, status_of
from tests.support.uids import as_uid

pytestmark = pytest.mark.fuse

NOBODY = 65534
WAIT = 60.0


@pytest.fixture
def base():
    """A 0755 dir outside pytest's 0700 tree, for what uid 65534 must reach
    (the source, the mount point, an interpreter it may run); everything
    under it is unmounted and killed at the end."""
    path = tempfile.mkdtemp(prefix="bc-keys-")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        cleanup(path)
        shutil.rmtree(path, ignore_errors=True)


def _open_errno(path: str) -> int:
    """0 if `path` opens (and reads) for this process, else the errno."""
    try:
        with open(path, "rb") as f:
            f.read(1)
        return 0
    except OSError as exc:
        return exc.errno


def _probe(pid: int, key: str) -> dict[str, int]:
    return {"mem": _open_errno(f"/proc/{pid}/mem"), "environ": _open_errno(f"/proc/{pid}/environ"),
            "key": _open_errno(key)}


def _fsclient_procs(mountpoint: str) -> dict[int, dict[str, str]]:
    """fsclient processes of `mountpoint`: pid -> /proc/PID/status (plus "serve":
    whether it is a server, `--serve-fd`)."""
    out = {}
    for pid in own_processes(mountpoint):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            status = status_of(pid)
        except OSError:
            continue
        if b"fsclient.cli" in argv:
            out[pid] = {**status, "serve": str(b"--serve-fd" in argv)}
    return out


def _await(what: str, found) -> int:
    deadline = time.monotonic() + WAIT
    while True:
        pid = found()
        if pid:
            return pid
        assert time.monotonic() < deadline, f"no {what} within {WAIT:g}s"
        time.sleep(0.05)


def _uid(status: dict[str, str]) -> int:
    return int(status["Uid"].split()[0])


def test_a_server_of_another_uid_gets_its_key_as_a_descriptor_and_is_not_dumpable(
        base, daemon, tmp_path):
    found = server_python(base)
    if found is None:
        pytest.skip("no Python that uid 65534 may run with this checkout's packages")
    python, environ = found
    tree = os.path.join(base, "remote")
    make_tree(tree)
    key = str(tmp_path / "volume.key")  # under pytest's 0700 tree, and 0600 root
    generate_key_file(key)
    os.chmod(key, 0o600)
    mp = os.path.join(base, "mnt")
    m = FsclientMount(tree, mp, key, daemon.socket_path, own_session=True,
                      args=["--block-size", str(BLOCK), "-o", "allow_other",
                            "--server-user", f"{NOBODY}:{NOBODY}"],
                      log_path=str(tmp_path / "mnt.log"), python=python, environ=environ)
    try:
        m.start()
        big = open(os.path.join(tree, "big.bin"), "rb").read()
        assert open(os.path.join(mp, "big.bin"), "rb").read() == big
        server = keeping.status(mp, expect_pid=m.proc.pid)["server"]
        assert _uid(status_of(server)) == NOBODY
        # as the server's uid: the key file shut, the server's memory and environment too
        seen = as_uid(NOBODY, NOBODY, _probe, server, key)
        assert seen["key"] == errno.EACCES, seen
        assert seen["mem"] in (errno.EACCES, errno.EPERM), seen
        assert seen["environ"] in (errno.EACCES, errno.EPERM), seen

        # the keeper killed: its server starts the next keeper (uid 65534), passing the key
        m.proc.kill()
        m.proc.wait(10)

        def successor() -> int:
            return next((pid for pid, st in _fsclient_procs(mp).items()
                         if st["serve"] == "False" and pid != m.proc.pid
                         and _uid(st) == NOBODY), 0)
        keeper = _await("keeper started by the server", successor)

        def its_server(other_than: int = 0) -> int:
            return next((pid for pid, st in _fsclient_procs(mp).items()
                         if st["serve"] == "True" and int(st["PPid"]) == keeper
                         and pid not in (server, other_than)), 0)
        second = _await("server of the new keeper", its_server)
        _await("handover of the old server", lambda: not os.path.exists(f"/proc/{server}"))
        assert as_uid(NOBODY, NOBODY, _probe, keeper, key)["environ"] in (errno.EACCES, errno.EPERM)
        # root trusts that keeper of another uid: the mount itself names it
        assert keeping.status(mp)["keeper"] == keeper
        # a mount that does not answer vouches for nobody, and accuses nobody:
        # that keeper is unvouched for now (ask again), not an impostor
        os.kill(second, signal.SIGSTOP)
        try:
            with pytest.raises(keeping.Unvouched) as unvouched:
                keeping.status(mp)
            assert f"pid {keeper} uid {NOBODY}" in str(unvouched.value)
            assert "did not answer" in str(unvouched.value)
        finally:
            os.kill(second, signal.SIGCONT)
        assert keeping.status(mp)["keeper"] == keeper
        # that keeper restarts a killed server, which reads the key from its descriptor
        os.kill(second, signal.SIGKILL)
        third = _await("server restarted by the new keeper", lambda: its_server(second))
        assert _uid(status_of(third)) == NOBODY
        for rel in ("dir1/sub1/file0.bin", "dir2/sub0/file1.bin", "big.bin"):
            fd = os.open(os.path.join(mp, rel), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (read by the server)
                assert os.read(fd, 16 << 20) == open(os.path.join(tree, rel), "rb").read()
            finally:
                os.close(fd)
        # (probed once it serves: from exec to its first line it holds nothing)
        assert as_uid(NOBODY, NOBODY, _probe, third, key)["mem"] in (errno.EACCES, errno.EPERM)
        assert "started keeper" in m.log() and "died" in m.log()
        res = fsclient("umount", mp)
        assert res.returncode == 0, res.stderr
        _await("the new keeper's exit", lambda: not os.path.exists(f"/proc/{keeper}"))
    finally:
        m.stop()


def test_mount_takes_the_key_as_an_open_descriptor(tree, daemon, tmp_path):
    """`fsclient mount --key-fd N`, for a caller that holds the key open (the
    CSI plugin): no key path is given to any process of the mount."""
    key = str(tmp_path / "volume.key")
    generate_key_file(key)
    mp = tmp_path / "mnt"
    mp.mkdir()
    fd = os.open(key, os.O_RDONLY)
    try:
        res = fsclient("mount", str(tree), str(mp), "--volume", "testvol", "--key-fd",
                       str(fd), "--socket", daemon.socket_path, pass_fds=(fd,))
    finally:
        os.close(fd)
    try:
        assert res.returncode == 0, res.stderr
        assert open(mp / "big.bin", "rb").read() == (tree / "big.bin").read_bytes()
        procs = _fsclient_procs(str(mp))
        assert len(procs) == 2  # the keeper and its server
        for pid in procs:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert key.encode() not in f.read()
    finally:
        res = fsclient("umount", str(mp))
    assert res.returncode == 0, res.stderr
    res = fsclient("mount", str(tree), str(mp), "--volume", "testvol", "--key-fd", "99")
    assert res.returncode == 1 and "--key-fd 99" in res.stderr, res.stderr
