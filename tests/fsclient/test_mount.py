"""A real mount shows the source exactly: tree, bytes, links, odd names; the
usual tools work; writes are refused; xattrs report cache state."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import tarfile
import time

import pytest

from tests.support.fsclient_mounts import env
from tests.support.trees import snapshot

pytestmark = pytest.mark.fuse


def test_tree_and_bytes_equal_the_source(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    want = snapshot(tree)
    assert b"odd-\xff\xfe.bin" in want
    assert snapshot(m.mountpoint) == want
    # second pass: now from the cache, still identical
    assert snapshot(m.mountpoint) == want
    st = m.stats()
    assert st["hits"] > 0


def test_find_cp_tar_stat_behave(tree, daemon, mounts, tmp_path):
    m = mounts(tree, daemon.socket_path)
    found = subprocess.run(["find", ".", "-type", "f"], cwd=m.mountpoint, capture_output=True,
                           check=True).stdout.split(b"\n")
    expected = subprocess.run(["find", ".", "-type", "f"], cwd=tree, capture_output=True,
                              check=True).stdout.split(b"\n")
    assert sorted(found) == sorted(expected)

    subprocess.run(["cp", "-r", m.mountpoint, str(tmp_path / "copy")], check=True)
    assert snapshot(tmp_path / "copy") == snapshot(tree)

    archive = tmp_path / "a.tar"
    subprocess.run(["tar", "cf", str(archive), "-C", m.mountpoint, "."], check=True)
    with tarfile.open(archive) as t:
        members = {os.path.normpath(x.name): x for x in t.getmembers()}
        big = t.extractfile(members["big.bin"]).read()
    assert hashlib.sha256(big).digest() == hashlib.sha256((tree / "big.bin").read_bytes()).digest()
    assert members["link"].issym() and members["link"].linkname == "dir0/sub0/file0.bin"

    out = subprocess.run(["stat", "-c", "%s %F %a", "big.bin", "link", "dir0"],
                         cwd=m.mountpoint, capture_output=True, text=True, check=True).stdout
    src = subprocess.run(["stat", "-c", "%s %F %a", "big.bin", "link", "dir0"],
                         cwd=tree, capture_output=True, text=True, check=True).stdout
    mine, theirs = out.splitlines(), src.splitlines()
    assert mine[0] == theirs[0]                      # size, type, mode of a file
    assert mine[1].split()[1:] == theirs[1].split()[1:]  # a symbolic link
    assert mine[2].split()[1:] == theirs[2].split()[1:]  # a directory


def test_inodes_are_stable_across_mounts(tree, daemon, mounts):
    a = mounts(tree, daemon.socket_path, name="a")
    b = mounts(tree, daemon.socket_path, name="b")
    for rel in ("big.bin", "dir1/sub0", "dir2/sub1/file0.bin"):
        ia = os.stat(os.path.join(a.mountpoint, rel)).st_ino
        assert ia == os.stat(os.path.join(b.mountpoint, rel)).st_ino
        assert int(os.getxattr(os.path.join(a.mountpoint, rel), "user.blockcache.inode")) == ia


def test_python_package_on_the_volume_imports(tree, daemon, mounts):
    pkg = tree / "code" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .mod import VALUE\n")
    (pkg / "mod.py").write_text("VALUE = 'imported from the volume'\n")
    m = mounts(tree, daemon.socket_path, args=["--dir-ttl", "code/=0"])
    code = ("import sys; sys.dont_write_bytecode = True; "
            f"sys.path.insert(0, {os.path.join(m.mountpoint, 'code')!r}); "
            "import mypkg; print(mypkg.VALUE, mypkg.__file__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("imported from the volume " + m.mountpoint)


def test_every_write_operation_is_erofs(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    mp = m.mountpoint
    f = os.path.join(mp, "big.bin")
    attempts = {
        "create": lambda: open(os.path.join(mp, "new.txt"), "w"),
        "open for write": lambda: open(f, "r+b"),
        "append": lambda: open(f, "ab"),
        "truncate": lambda: os.truncate(f, 0),
        "mkdir": lambda: os.mkdir(os.path.join(mp, "newdir")),
        "rmdir": lambda: os.rmdir(os.path.join(mp, "empty")),
        "unlink": lambda: os.unlink(f),
        "rename": lambda: os.rename(f, os.path.join(mp, "moved.bin")),
        "symlink": lambda: os.symlink("big.bin", os.path.join(mp, "l2")),
        "link": lambda: os.link(f, os.path.join(mp, "hard")),
        "chmod": lambda: os.chmod(f, 0o600),
        "utime": lambda: os.utime(f, (1, 1)),
        "setxattr": lambda: os.setxattr(f, "user.x", b"1"),
        "removexattr": lambda: os.removexattr(f, "user.blockcache.version"),
        "mknod": lambda: os.mkfifo(os.path.join(mp, "fifo")),
    }
    for what, op in attempts.items():
        with pytest.raises(OSError) as exc:
            op()
        assert exc.value.errno == errno.EROFS, what
    assert snapshot(mp) == snapshot(tree)


def test_xattrs_show_cache_state(tree, daemon, mounts):
    m = mounts(tree, daemon.socket_path)
    path = os.path.join(m.mountpoint, "big.bin")
    size = os.path.getsize(path)
    names = os.listxattr(path)
    assert {"user.blockcache.cached_bytes", "user.blockcache.version"} <= set(names)
    assert int(os.getxattr(path, "user.blockcache.cached_bytes")) == 0
    version = os.getxattr(path, "user.blockcache.version").decode()
    assert version.endswith(f"-{size}")  # local backend: mtime_ns-size
    with open(path, "rb") as f:
        assert len(f.read()) == size
    # the mount's fill thread sends its puts some time after the read (under
    # load, after the daemon already looked idle): wait for both to drain
    deadline = time.monotonic() + 20
    while int(os.getxattr(path, "user.blockcache.cached_bytes")) != size:
        assert time.monotonic() < deadline, "the read's blocks never became cached"
        daemon.wait_idle()
        time.sleep(0.05)
    other = os.path.join(m.mountpoint, "dir0", "sub0", "file1.bin")
    assert int(os.getxattr(other, "user.blockcache.cached_bytes")) == 0
    with pytest.raises(OSError) as exc:
        os.getxattr(path, "user.blockcache.nope")
    assert exc.value.errno == errno.ENODATA


def test_large_directory_is_paged_completely(tmp_path, daemon, mounts):
    src = tmp_path / "wide"
    src.mkdir()
    names = {f"entry-with-a-long-name-{i:05d}.dat" for i in range(3000)}
    for n in names:
        (src / n).write_bytes(n.encode())
    m = mounts(src, daemon.socket_path)
    assert set(os.listdir(m.mountpoint)) == names
    with os.scandir(m.mountpoint) as it:
        assert sum(1 for _ in it) == 3000
