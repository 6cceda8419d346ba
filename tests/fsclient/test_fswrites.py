"""Writable mounts, with the writers that matter, on a local directory and on
moto S3: safetensors' save_file (a temp file, ftruncate, rename while open), a
DCP-style sequence (per-rank files with fsync, `.metadata.tmp`, unlink,
rename), numpy.save, zipfile seeking back, tarfile. The bytes read through the
mount and straight from the remote are equal to a local file written the same
way, and the object is absent until the close returns. Also: in-place writes
are refused, close-to-open on the mount, staging full, failed uploads, other
uids, and a server killed mid-write."""

from __future__ import annotations

import errno
import io
import os
import tarfile
import zipfile

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from devtools.s3server import S3Server
from tests.support.fsclient_mounts import FsclientMount, s3_config
from tests.support.keepers import kill_server, serving
from tests.support.s3front import S3Front
from tests.support.uids import ChildError, as_uid

pytestmark = pytest.mark.fuse

MiB = 1 << 20
NOBODY = 65534


class Remote:
    """A volume's remote, read and written around the mount."""

    def __init__(self, kind: str, tmp_path, s3: S3Server | None = None):
        self.kind = kind
        self.args: list[str] = []
        if kind == "local":
            self.root = str(tmp_path / "remote")
            os.makedirs(self.root)
            self.url = self.root
            return
        self.fs = s3.filesystem()
        self.base = f"{s3.bucket}/w-{os.urandom(6).hex()}"
        self.fs.pipe(f"{self.base}/.keep", b"")
        self.url = f"s3://{self.base}"
        self.args = s3_config(tmp_path / "s3.toml", s3)

    def read(self, rel: str) -> bytes | None:
        """The object at `rel`, straight from the remote; None if there is none."""
        if self.kind == "local":
            path = os.path.join(self.root, rel)
            return open(path, "rb").read() if os.path.isfile(path) else None
        self.fs.invalidate_cache()
        path = f"{self.base}/{rel}"
        return self.fs.cat(path) if self.fs.exists(path) else None

    def names(self, rel: str = "") -> list[str]:
        if self.kind == "local":
            return sorted(os.listdir(os.path.join(self.root, rel)))
        self.fs.invalidate_cache()
        top = f"{self.base}/{rel}".rstrip("/")
        return sorted(p.rpartition("/")[2] for p in self.fs.ls(top)
                      if not p.endswith("/.keep") and p.rstrip("/") != top)

    def write(self, rel: str, data: bytes) -> None:
        if self.kind == "local":
            path = os.path.join(self.root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        else:
            self.fs.pipe(f"{self.base}/{rel}", data)


@pytest.fixture(params=["local", "s3"])
def remote(request, tmp_path):
    s3 = request.getfixturevalue("s3") if request.param == "s3" else None
    return Remote(request.param, tmp_path, s3)


@pytest.fixture
def writable(remote, tmp_path, daemon, mounts):
    """A writable mount of `remote` (staging under tmp_path)."""
    (tmp_path / "staging").mkdir()

    def make(name="mnt", args=()):
        return mounts(remote.url, daemon.socket_path, name=name,
                      args=["--writable", "--staging-dir", str(tmp_path / "staging"),
                            *remote.args, *args])
    return make


def same_everywhere(remote, mnt: str, rel: str, want: bytes) -> None:
    assert remote.read(rel) == want
    with open(os.path.join(mnt, rel), "rb") as f:
        assert f.read() == want


# -- the writers -------------------------------------------------------------------------

def test_safetensors_save_file(remote, writable, tmp_path):
    m = writable()
    tensors = {"embed": np.arange(300_000, dtype=np.float32).reshape(600, 500),
               "bias": np.ones(7, dtype=np.int64)}
    save_file(tensors, str(tmp_path / "local.safetensors"))
    want = (tmp_path / "local.safetensors").read_bytes()
    remote.write("model.safetensors", b"the previous checkpoint")
    path = os.path.join(m.mountpoint, "model.safetensors")
    save_file(tensors, path)  # .tmpXXXX, ftruncate, writes, rename while open, close
    same_everywhere(remote, m.mountpoint, "model.safetensors", want)
    assert remote.names() == ["model.safetensors"]  # no temp file left anywhere
    loaded = load_file(path)
    assert all(np.array_equal(loaded[k], v) for k, v in tensors.items())


def test_a_dcp_style_checkpoint(remote, writable):
    m = writable()
    step_dir = os.path.join(m.mountpoint, "step")
    os.mkdir(step_dir)
    for step in range(2):
        for rank in range(2):
            rel = f"step/__{rank}_0.distcp"
            data = os.urandom(3 * MiB + rank) + b"step %d" % step
            with open(os.path.join(m.mountpoint, rel), "wb") as f:
                f.write(data)
                f.flush()
                assert remote.read(rel) != data  # not there before the fsync returns
                os.fsync(f.fileno())
                assert remote.read(rel) == data
            same_everywhere(remote, m.mountpoint, rel, data)
        meta = b"metadata of step %d" % step
        with open(os.path.join(step_dir, ".metadata.tmp"), "wb") as f:
            f.write(meta)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(os.path.join(step_dir, ".metadata")):
            os.unlink(os.path.join(step_dir, ".metadata"))
        os.rename(os.path.join(step_dir, ".metadata.tmp"), os.path.join(step_dir, ".metadata"))
        same_everywhere(remote, m.mountpoint, "step/.metadata", meta)
        assert remote.read("step/.metadata.tmp") is None
        assert not os.path.exists(os.path.join(step_dir, ".metadata.tmp"))
    assert sorted(os.listdir(step_dir)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_numpy_save(remote, writable):
    m = writable()
    arr = np.random.default_rng(1).random((700, 800))
    want = io.BytesIO()
    np.save(want, arr)
    f = open(os.path.join(m.mountpoint, "arr.npy"), "wb")
    assert remote.read("arr.npy") is None
    np.save(f, arr)
    f.flush()
    # ndarray.tofile writes through a duplicate of the descriptor and closes
    # it: a close, so the whole file may be there already, never a part of it
    assert remote.read("arr.npy") in (None, want.getvalue())
    f.close()
    same_everywhere(remote, m.mountpoint, "arr.npy", want.getvalue())
    assert np.array_equal(np.load(os.path.join(m.mountpoint, "arr.npy")), arr)


def _zip(fobj) -> None:
    """A zip written as torch.save writes one: entries streamed, each local
    header patched afterwards (zipfile seeks back to it)."""
    with zipfile.ZipFile(fobj, "w", zipfile.ZIP_STORED) as z:
        for i, size in enumerate((100, 3 * MiB + 5, 0, 70_000)):
            info = zipfile.ZipInfo(f"archive/data/{i}", date_time=(2024, 1, 1, 0, 0, 0))
            with z.open(info, "w") as entry:
                entry.write(bytes([i + 1]) * size)


def _tar(fobj) -> None:
    with tarfile.open(fileobj=fobj, mode="w") as t:
        for i, size in enumerate((10, 2 * MiB + 3, 0)):
            info = tarfile.TarInfo(f"shard/{i}.bin")
            info.size, info.mtime = size, 1_700_000_000
            t.addfile(info, io.BytesIO(bytes([65 + i]) * size))


def _zip_entries(path: str) -> list[int]:
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        return [i.file_size for i in z.infolist()]


def _tar_entries(path: str) -> list[int]:
    with tarfile.open(path) as t:
        return [x.size for x in t.getmembers()]


@pytest.mark.parametrize("name,write,entries,sizes", [
    ("model.pt", _zip, _zip_entries, [100, 3 * MiB + 5, 0, 70_000]),
    ("shard.tar", _tar, _tar_entries, [10, 2 * MiB + 3, 0]),
], ids=["zipfile-seeking-back", "tarfile"])
def test_archives(remote, writable, name, write, entries, sizes):
    m = writable()
    want = io.BytesIO()
    write(want)
    f = open(os.path.join(m.mountpoint, name), "wb")
    write(f)
    assert remote.read(name) is None  # absent until the close returns
    f.close()
    same_everywhere(remote, m.mountpoint, name, want.getvalue())
    assert entries(os.path.join(m.mountpoint, name)) == sizes


# -- what else a writable mount does ----------------------------------------------------

def test_writing_in_place_is_refused_with_eopnotsupp(remote, writable):
    remote.write("ckpt.bin", b"a whole checkpoint")
    remote.write("empty.bin", b"")
    m = writable()
    path = os.path.join(m.mountpoint, "ckpt.bin")
    for mode in ("r+b", "ab"):
        with pytest.raises(OSError) as err:
            open(path, mode)
        assert err.value.errno == errno.EOPNOTSUPP, mode
    with pytest.raises(OSError) as err:
        os.truncate(path, 5)
    assert err.value.errno == errno.EOPNOTSUPP
    with open(os.path.join(m.mountpoint, "empty.bin"), "r+b") as f:  # nothing to keep
        f.write(b"now it has bytes")
    assert remote.read("empty.bin") == b"now it has bytes"
    os.truncate(path, 0)  # to nothing: a whole (empty) object
    assert remote.read("ckpt.bin") == b""


def test_close_to_open_on_the_mount_whatever_the_ttl(remote, writable):
    remote.write("d/w.bin", b"old bytes")
    m = writable(args=["--meta-ttl", "3600"])
    path = os.path.join(m.mountpoint, "d", "w.bin")
    assert open(path, "rb").read() == b"old bytes"
    assert sorted(os.listdir(os.path.join(m.mountpoint, "d"))) == ["w.bin"]
    with open(path, "wb") as f:
        f.write(b"new, longer bytes")
        f.flush()
        assert os.stat(path).st_size == 17  # its staged size while open
    assert open(path, "rb").read() == b"new, longer bytes"
    assert os.stat(path).st_size == 17
    with open(os.path.join(m.mountpoint, "d", "n.bin"), "wb") as f:
        f.write(b"new file")
    assert sorted(os.listdir(os.path.join(m.mountpoint, "d"))) == ["n.bin", "w.bin"]


def test_metadata_ops_through_the_mount(remote, writable):
    remote.write("full/f.bin", b"x")
    m = writable()
    mp = m.mountpoint
    os.makedirs(os.path.join(mp, "a", "b"))
    assert os.path.isdir(os.path.join(mp, "a", "b"))
    with open(os.path.join(mp, "a", "b", "zero"), "wb"):
        pass
    assert remote.read("a/b/zero") == b"" and os.path.getsize(os.path.join(mp, "a/b/zero")) == 0
    os.rename(os.path.join(mp, "a/b/zero"), os.path.join(mp, "a/zero2"))
    assert remote.read("a/zero2") == b"" and remote.read("a/b/zero") is None
    assert os.listdir(os.path.join(mp, "a", "b")) == []
    os.rmdir(os.path.join(mp, "a", "b"))
    for call, code in ((lambda: os.rmdir(os.path.join(mp, "full")), errno.ENOTEMPTY),
                       (lambda: os.mkdir(os.path.join(mp, "full")), errno.EEXIST),
                       (lambda: os.unlink(os.path.join(mp, "full")), errno.EISDIR),
                       (lambda: os.symlink("x", os.path.join(mp, "l")), errno.EOPNOTSUPP),
                       (lambda: os.chmod(os.path.join(mp, "a/zero2"), 0o600), errno.EPERM)):
        with pytest.raises(OSError) as err:
            call()
        assert err.value.errno == code
    if remote.kind == "s3":  # a directory is many objects there: mv copies it
        with pytest.raises(OSError) as err:
            os.rename(os.path.join(mp, "full"), os.path.join(mp, "moved"))
        assert err.value.errno == errno.EXDEV
    os.unlink(os.path.join(mp, "a/zero2"))
    os.rmdir(os.path.join(mp, "a"))
    assert remote.read("a/zero2") is None and not os.path.exists(os.path.join(mp, "a"))


def test_a_name_renamed_away_and_written_again_is_another_file(remote, writable):
    """The kernel keeps a renamed file's node id (the old name's hash) for the
    new name; the old name written again must be a new inode, not that one."""
    m = writable()
    a, b = os.path.join(m.mountpoint, "a"), os.path.join(m.mountpoint, "b")
    with open(a, "wb") as f:
        f.write(b"first file")
    os.rename(a, b)
    with open(a, "wb") as f:
        f.write(b"the second, longer file")
    assert os.stat(a).st_size == 23 and os.stat(b).st_size == 10
    assert os.stat(a).st_ino != os.stat(b).st_ino
    assert open(a, "rb").read() == b"the second, longer file"
    assert open(b, "rb").read() == b"first file"
    os.rename(a, b)  # over it, twice in a row
    assert open(b, "rb").read() == b"the second, longer file" and not os.path.exists(a)
    assert remote.read("b") == b"the second, longer file" and remote.read("a") is None


def test_staging_full_gives_enospc(remote, writable):
    m = writable(args=["--staging-bytes", "3M"])
    with pytest.raises(OSError) as err:
        with open(os.path.join(m.mountpoint, "big.bin"), "wb") as f:
            f.write(b"a" * (5 * MiB))
    assert err.value.errno == errno.ENOSPC
    assert "raise staging_bytes" in m.log()
    assert os.statvfs(m.mountpoint).f_blocks * 4096 == 3 * MiB


def test_a_server_killed_mid_write_leaves_no_partial_object(remote, writable, tmp_path):
    m = writable()
    path = os.path.join(m.mountpoint, "ckpt.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"x" * (3 * MiB))
        old = kill_server(m.mountpoint)
        serving(m.mountpoint, other_than=old)
        with pytest.raises(OSError) as err:  # its staged bytes died with the server
            os.write(fd, b"y" * MiB)
        assert err.value.errno == errno.EIO
    finally:
        with pytest.raises(OSError):
            os.close(fd)
    assert remote.read("ckpt.bin") is None
    assert os.listdir(tmp_path / "staging") == []  # nameless staged files: nothing left
    with open(path, "wb") as f:  # the new server writes
        f.write(b"saved")
    assert remote.read("ckpt.bin") == b"saved"


def test_every_write_op_as_a_uid_that_may_not_write(tmp_path, shared_dir, key_file, daemon):
    src = tmp_path / "remote"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.bin").write_bytes(b"theirs")
    (src / "empty").mkdir()
    os.chmod(key_file, 0o400)
    m = FsclientMount(str(src), os.path.join(shared_dir, "mnt"), str(key_file),
                      daemon.socket_path, args=["--writable", "--staging-dir", str(tmp_path),
                                                "-o", "allow_other"],
                      log_path=str(tmp_path / "mnt.log"))
    os.makedirs(m.mountpoint)
    m.start()
    try:
        mp = m.mountpoint
        f = os.path.join(mp, "d", "f.bin")

        def attempts():
            out = {}
            for what, op in {
                "create": lambda: open(os.path.join(mp, "d", "new"), "wb"),
                "truncating open": lambda: open(f, "wb"),
                "truncate": lambda: os.truncate(f, 0),
                "mkdir": lambda: os.mkdir(os.path.join(mp, "d", "sub")),
                "rmdir": lambda: os.rmdir(os.path.join(mp, "empty")),
                "unlink": lambda: os.unlink(f),
                "rename": lambda: os.rename(f, os.path.join(mp, "d", "g.bin")),
                "rename into": lambda: os.rename(f, os.path.join(mp, "g.bin")),
                "chmod": lambda: os.chmod(f, 0o666),
                "utime": lambda: os.utime(f, (1, 1)),
            }.items():
                try:
                    op()
                    out[what] = 0
                except OSError as exc:
                    out[what] = exc.errno
            return out
        got = as_uid(NOBODY, NOBODY, attempts)
        assert all(code in (errno.EACCES, errno.EPERM) for code in got.values()), got
        assert sorted(os.listdir(src / "d")) == ["f.bin"]
        assert (src / "d" / "f.bin").read_bytes() == b"theirs"
        with open(os.path.join(mp, "d", "mine"), "wb") as mine:  # the mount's owner may
            mine.write(b"ok")
        with pytest.raises(ChildError) as err:  # nobody may not write it
            as_uid(NOBODY, NOBODY, lambda: open(os.path.join(mp, "d", "mine"), "wb"))
        assert err.value.errno in (errno.EACCES, errno.EPERM)
    finally:
        m.stop()


def test_a_failed_upload_fails_the_close_with_eio(s3, tmp_path, daemon, mounts):
    with S3Front(s3.endpoint_url) as front:
        remote = Remote("s3", tmp_path, s3)
        o = s3.storage_options
        (tmp_path / "s3.toml").write_text(  # through the front, and no retries
            f'[storage_options]\nendpoint_url = "{front.url}"\nkey = "{o["key"]}"\n'
            f'secret = "{o["secret"]}"\nattempts = 1\n'
            f'[storage_options.client_kwargs]\nregion_name = "us-east-1"\n'
            f'[storage_options.config_kwargs.retries]\nmax_attempts = 1\n')
        (tmp_path / "staging").mkdir()
        m = mounts(remote.url, daemon.socket_path,
                   args=["--writable", "--staging-dir", str(tmp_path / "staging"), *remote.args])
        front.fail_writes(403, "partNumber=2")
        f = open(os.path.join(m.mountpoint, "ckpt.bin"), "wb")
        f.write(os.urandom(12 * MiB))
        with pytest.raises(OSError) as err:
            f.close()
        assert err.value.errno == errno.EIO
        assert remote.read("ckpt.bin") is None
        assert os.listdir(tmp_path / "staging") == []
        front.clear_writes()
        with open(os.path.join(m.mountpoint, "ckpt.bin"), "wb") as f:
            f.write(b"saved on the second try")
        assert remote.read("ckpt.bin") == b"saved on the second try"


def test_an_open_on_another_mount_of_this_host_sees_the_new_version(remote, writable, mounts,
                                                                     daemon):
    remote.write("ckpt/latest.bin", b"step 1")
    w = writable()
    r = mounts(remote.url, daemon.socket_path, name="reader",
               args=["--meta-ttl", "3600", *remote.args])  # read-only, metadata for an hour
    theirs = os.path.join(r.mountpoint, "ckpt", "latest.bin")
    assert open(theirs, "rb").read() == b"step 1"  # its version held for an hour
    with open(os.path.join(w.mountpoint, "ckpt", "latest.bin"), "wb") as f:
        f.write(b"step 2, a longer checkpoint")
    assert open(theirs, "rb").read() == b"step 2, a longer checkpoint"
    with open(os.path.join(w.mountpoint, "ckpt", "tmp.bin"), "wb") as f:
        f.write(b"step 3")
    os.rename(os.path.join(w.mountpoint, "ckpt", "tmp.bin"),
              os.path.join(w.mountpoint, "ckpt", "latest.bin"))
    with open(theirs, "rb") as f:
        assert f.read() == b"step 3"
        assert os.fstat(f.fileno()).st_size == 6
