"""Mount lifecycle and bad input: background mode with readiness, umount,
SIGTERM, kill -9 recovery, and clear failures (or the right errno) for a
missing/busy mount point, a bad source, a bad key, an absent daemon, a file
deleted remotely while open."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import time

import pytest

from tests.support.fsclient_mounts import force_unmount, fsclient, is_mounted
from tests.support.trees import snapshot

pytestmark = pytest.mark.fuse


def _pids_serving(mountpoint: str) -> list[int]:
    """fsclient processes whose command line names `mountpoint`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"fsclient.cli" in argv and os.fsencode(mountpoint) in argv:
            out.append(int(pid))
    return out


@pytest.fixture
def background(tmp_path):
    """Mount points used by background mounts; whatever is left is unmounted
    and its process killed at teardown."""
    used: list[str] = []

    def make(name: str = "bg") -> str:
        mp = str(tmp_path / name)
        os.makedirs(mp, exist_ok=True)
        used.append(mp)
        return mp

    try:
        yield make
    finally:
        for mp in used:
            force_unmount(mp)
            for pid in _pids_serving(mp):
                os.kill(pid, signal.SIGKILL)


def mount_args(src, mp, key, sock, *extra):
    return ["mount", str(src), str(mp), "--volume", "testvol", "--key-file", str(key),
            "--socket", str(sock), *extra]


def test_background_mount_returns_when_ready_and_umount_ends_it(tree, key_file, daemon,
                                                                 background, tmp_path):
    mp = background()
    res = fsclient(*mount_args(tree, mp, key_file, daemon.socket_path, "--log-file",
                               str(tmp_path / "bg.log")))
    assert res.returncode == 0, res.stderr
    assert is_mounted(mp)
    assert snapshot(mp) == snapshot(tree)
    pids = _pids_serving(mp)
    assert len(pids) == 2  # the keeper and its server
    res = fsclient("umount", mp)
    assert res.returncode == 0, res.stderr
    assert not is_mounted(mp)
    deadline = time.monotonic() + 10
    while _pids_serving(mp) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pids_serving(mp), "the mount process outlived its unmount"
    res = fsclient("umount", mp)
    assert res.returncode == 1 and "not mounted" in res.stderr


def test_sigterm_unmounts_cleanly(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    assert m.stop() == 0
    assert not is_mounted(m.mountpoint)


def test_sigterm_with_a_file_open_ends_the_mount_too(tree, daemon, mounts):
    # a lazy unmount leaves the connection alive while files are open: the
    # process still exits, and the open file then fails instead of hanging
    m = mounts(tree, daemon.socket_path)
    held = os.open(os.path.join(m.mountpoint, "big.bin"), os.O_RDONLY)
    try:
        assert len(os.pread(held, 1000, 0)) == 1000
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(20) == 0
        assert not is_mounted(m.mountpoint)
        with pytest.raises(OSError) as exc:
            os.pread(held, 1000, 4 << 20)
        assert exc.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    finally:
        with contextlib.suppress(OSError):  # (its flush fails the same way)
            os.close(held)


def test_fsclient_killed_then_next_mount_recovers_the_mount_point(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    m.kill9()  # keeper and server: nothing holds the connection any more
    assert not _pids_serving(m.mountpoint)
    with pytest.raises(OSError) as exc:
        os.listdir(m.mountpoint)
    assert exc.value.errno == errno.ENOTCONN
    again = mounts(tree, daemon.socket_path)  # same name -> same mount point
    assert any("dead FUSE mount" in w for w in again.warnings), again.warnings
    assert snapshot(again.mountpoint) == snapshot(tree)


def test_missing_and_busy_mount_points_are_refused(tree, key_file, daemon, mounts, tmp_path):
    res = fsclient(*mount_args(tree, tmp_path / "nope", key_file, daemon.socket_path))
    assert res.returncode == 1
    assert "does not exist" in res.stderr and "mkdir -p" in res.stderr
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(other)], check=True, timeout=30)
    try:  # a mount that is not fsclient's is never touched
        res = fsclient(*mount_args(tree, other, key_file, daemon.socket_path))
        assert res.returncode == 1
        assert "busy" in res.stderr and "already mounted" in res.stderr
    finally:
        subprocess.run(["umount", "-l", str(other)], timeout=30)
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = fsclient(*mount_args(tree, afile, key_file, daemon.socket_path))
    assert res.returncode == 1 and "not a directory" in res.stderr


def test_bad_source_fails_with_the_reason(key_file, daemon, background, tmp_path):
    mp = background()
    res = fsclient(*mount_args(tmp_path / "no-such-dir", mp, key_file, daemon.socket_path))
    assert res.returncode == 1
    assert "no-such-dir" in res.stderr
    assert not is_mounted(mp)
    res = fsclient(*mount_args("nosuchproto://x/y", mp, key_file, daemon.socket_path))
    assert res.returncode == 1 and "nosuchproto" in res.stderr
    assert not is_mounted(mp)
    assert "Traceback" not in res.stderr


def test_bad_key_files_fail_with_the_fix(tree, daemon, background, tmp_path):
    mp = background()
    res = fsclient(*mount_args(tree, mp, tmp_path / "absent.key", daemon.socket_path))
    assert res.returncode == 1 and "fsclient keygen" in res.stderr
    loose = tmp_path / "loose.key"
    loose.write_text("00" * 32 + "\n")
    os.chmod(loose, 0o644)
    res = fsclient(*mount_args(tree, mp, loose, daemon.socket_path))
    assert res.returncode == 1 and "chmod 0400" in res.stderr
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key\n")
    os.chmod(garbage, stat.S_IRUSR)
    res = fsclient(*mount_args(tree, mp, garbage, daemon.socket_path))
    assert res.returncode == 1 and "does not hold a volume key" in res.stderr
    assert not is_mounted(mp)


def test_bad_config_is_refused(tree, key_file, background, tmp_path):
    mp = background()
    cfg = tmp_path / "vol.toml"
    cfg.write_text(f'volume = "v"\nsource = "{tree}"\nmountpoint = "{mp}"\n'
                   f'key_file = "{key_file}"\nmeta_tll = 5\n')
    res = fsclient("mount", "--config", str(cfg))
    assert res.returncode == 1 and "meta_tll" in res.stderr
    res = fsclient(*mount_args(tree, mp, key_file, "/nonexistent.sock", "--dir-ttl", "code"))
    assert res.returncode == 1 and "PREFIX=SECONDS" in res.stderr


def test_config_file_alone_mounts(tree, key_file, daemon, background, tmp_path):
    mp = background()
    cfg = tmp_path / "vol.toml"
    cfg.write_text(f'volume = "testvol"\nsource = "{tree}"\nmountpoint = "{mp}"\n'
                   f'key_file = "{key_file}"\nsocket = "{daemon.socket_path}"\n'
                   f'block_size = "256K"\n[dir_ttl]\n"dir0/" = 0\n')
    res = fsclient("mount", "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    assert snapshot(mp) == snapshot(tree)
    assert fsclient("umount", mp).returncode == 0


def test_absent_daemon_mounts_uncached_with_a_warning(tree, key_file, background, tmp_path):
    mp = background()
    res = fsclient(*mount_args(tree, mp, key_file, tmp_path / "no-daemon.sock"))
    assert res.returncode == 0, res.stderr
    assert "warning" in res.stderr and "blockcached is not reachable" in res.stderr
    assert snapshot(mp) == snapshot(tree)
    st = json.loads(os.getxattr(mp, "user.blockcache.stats"))
    assert st["daemon_unavailable"] > 0 and st["backend_bytes"] > 0
    assert fsclient("umount", mp).returncode == 0


def test_odd_bytes_in_names_round_trip(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    names = os.listdir(os.fsencode(m.mountpoint))
    assert b"odd-\xff\xfe.bin" in names
    with open(os.path.join(os.fsencode(m.mountpoint), b"odd-\xff\xfe.bin"), "rb") as f:
        assert f.read() == b"odd bytes\n"
    assert "odd-\udcff\udcfe.bin" in os.listdir(m.mountpoint)  # str API, surrogateescape


def test_file_deleted_remotely_while_open_gives_an_errno(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    path = os.path.join(m.mountpoint, "big.bin")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert len(os.pread(fd, 100, 0)) == 100
        os.unlink(tree / "big.bin")
        with pytest.raises(OSError) as exc:
            os.pread(fd, 100, 4 << 20)
        assert exc.value.errno in (errno.ESTALE, errno.EIO, errno.ENOENT)
    finally:
        os.close(fd)
    # the mount is alive and answers
    assert "dir0" in os.listdir(m.mountpoint)
    assert os.path.getsize(os.path.join(m.mountpoint, "with space.txt")) == 7


def test_umount_of_a_busy_mount_says_how_and_lazy_works(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path, args=["-o", "allow_other"])
    with open("/proc/self/mounts") as f:
        opts = next(line.split()[3] for line in f if line.split()[1] == m.mountpoint)
    assert "allow_other" in opts.split(",") and "ro" in opts.split(",")
    with open(os.path.join(m.mountpoint, "big.bin"), "rb") as held:
        res = fsclient("umount", m.mountpoint)
        assert res.returncode == 1 and "--lazy" in res.stderr
        assert is_mounted(m.mountpoint)
        res = fsclient("umount", "--lazy", m.mountpoint)
        assert res.returncode == 0, res.stderr
        assert not is_mounted(m.mountpoint)
        assert len(held.read(1000)) == 1000  # a detached mount still serves open files
    assert m.proc.wait(15) == 0  # and its process exits once they are closed


def test_json_logs(tree, key_file, background, tmp_path):
    mp = background()
    log = tmp_path / "json.log"
    res = fsclient("--log-format", "json", *mount_args(tree, mp, key_file,
                                                        tmp_path / "none.sock",
                                                        "--log-file", str(log)))
    assert res.returncode == 0, res.stderr
    assert fsclient("umount", mp).returncode == 0
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert any(r["level"].lower() == "warning" and "not reachable" in r["message"] for r in lines)
    assert any("mounted" in r["message"] for r in lines)
