"""`safeopen.open_beneath`: no symlink in any component, with openat2 and
with the per-component O_NOFOLLOW walk used where openat2 is missing."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from blockcache_client.common import safeopen


@pytest.fixture(params=["openat2", "walk"])
def mode(request, monkeypatch):
    if request.param == "openat2" and not safeopen.SUPPORTED:
        pytest.skip("no openat2 here")
    if request.param == "walk":  # as on a kernel that answered ENOSYS
        monkeypatch.setattr(safeopen, "_refused", [True])
    return request.param


def test_plain_path_opens(tmp_path, mode):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"hello")
    root = safeopen.open_dir(str(tmp_path))
    try:
        fd = safeopen.open_beneath(root, "a/b/f", os.O_RDONLY)
        assert os.read(fd, 10) == b"hello"
        os.close(fd)
    finally:
        os.close(root)


@pytest.mark.parametrize("where", ["a", "a/b", "a/b/f"])
def test_a_symlink_in_any_component_is_refused(tmp_path, mode, where):
    outside = tmp_path / "outside"
    (outside / "b").mkdir(parents=True)
    (outside / "b" / "f").write_bytes(b"secret")
    (outside / "f").write_bytes(b"secret")
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_bytes(b"mine")
    link = tree / where
    target = {"a": outside, "a/b": outside / "b", "a/b/f": outside / "f"}[where]
    if link.is_dir():
        shutil.rmtree(link)
    else:
        link.unlink()
    link.symlink_to(target)
    root = safeopen.open_dir(str(tree))
    try:
        with pytest.raises(OSError) as exc:
            os.close(safeopen.open_beneath(root, "a/b/f", os.O_RDONLY))
        assert exc.value.errno in (errno.ELOOP, errno.ENOTDIR)
    finally:
        os.close(root)


def test_dotdot_never_leaves_the_dir(tmp_path, mode):
    (tmp_path / "t").mkdir()
    (tmp_path / "f").write_bytes(b"x")
    root = safeopen.open_dir(str(tmp_path / "t"))
    try:
        with pytest.raises(OSError) as exc:
            safeopen.open_beneath(root, "../f", os.O_RDONLY)
        assert exc.value.errno in (errno.EXDEV, errno.ELOOP)
    finally:
        os.close(root)
