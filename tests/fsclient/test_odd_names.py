"""Names POSIX and S3 allow but that look like trouble, through FUSE and `Volume`.

Only '/' separates a path: a backslash (datasets exported by Windows tools),
a newline, '#', '%', quotes, unicode and long names are names like any other.
An entry no path can name (an S3 key with '//') is left out of its listing,
never failing it. A symbolic link's lstat size is the length of its target.
"""

from __future__ import annotations

import os
import random
import subprocess

import boto3
import pytest

from blockcache_client import Volume
from tests.support.fsclient_mounts import FsclientMount, s3_config

pytestmark = pytest.mark.fuse

BS = 64 << 10
ODD_NAMES = [
    "back\\slash.txt", "trailing\\", "new\nline", "tab\there", "hash#1", "pct%20x",
    "quote'\"s", "ünïcode", "n" * 200, "plain.bin",
]


def _odd_files() -> dict[str, bytes]:
    rng = random.Random(5)
    files = {f"d/{name}": rng.randbytes(100 + 7 * i) for i, name in enumerate(ODD_NAMES)}
    files["win\\dir/inner.bin"] = rng.randbytes(BS + 10)  # a directory with a backslash
    files["d/multi\\block.bin"] = rng.randbytes(3 * BS + 5)
    return files


def _local_source(tmp_path, files):
    root = tmp_path / "remote"
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return str(root), {}, []


def _s3_source(tmp_path, s3, files):
    fs = s3.filesystem()
    for rel, data in files.items():
        fs.pipe(f"{s3.bucket}/odd/{rel}", data)
    o = s3.storage_options
    # keys no path can name (s3fs would refuse to write them): left out of listings
    raw = boto3.client("s3", endpoint_url=o["endpoint_url"], aws_access_key_id=o["key"],
                       aws_secret_access_key=o["secret"], region_name="us-east-1")
    for key in ("odd/d//double-slash", "odd/d/../dot-dot"):
        raw.put_object(Bucket=s3.bucket, Key=key, Body=b"unreachable")
    return s3.url("odd"), o, s3_config(tmp_path / "fsclient.toml", s3)


@pytest.fixture(params=["local", "s3"])
def odd_source(request, tmp_path):
    files = _odd_files()
    if request.param == "local":
        return files, *_local_source(tmp_path, files)
    # moto's server answers 404 to any request for a key holding a newline
    files = {rel: data for rel, data in files.items() if "\n" not in rel}
    return files, *_s3_source(tmp_path, request.getfixturevalue("s3"), files)


def test_odd_names_read_through_fuse_and_volume(odd_source, tmp_path, key_file, daemon,
                                                caplog):
    files, url, options, mount_args = odd_source
    want_d = sorted(r[2:] for r in files if r.startswith("d/"))
    with Volume("odd", url, str(key_file), socket_path=daemon.socket_path,
                block_size=BS, **options) as vol:
        assert sorted(e.name for e in vol.listdir("d")) == want_d
        if url.startswith("s3://"):  # the '..' key is named in a warning ('d//' is 'd' to s3fs)
            assert "d/..', which cannot be a path in the volume" in caplog.text
        assert [e.name for e in vol.listdir("win\\dir")] == ["inner.bin"]
        for rel, data in files.items():
            assert vol.read(rel, 0, 1 << 20) == data, rel
            with vol.open(rel) as f:
                assert f.read() == data, rel
        assert vol.wait_fills(10)
    daemon.wait_idle()
    mount = FsclientMount(url, str(tmp_path / "mnt"), str(key_file), daemon.socket_path,
                          volume="odd", args=["--block-size", str(BS), *mount_args],
                          log_path=str(tmp_path / "mnt.log"))
    try:
        mount.start()
        mnt = mount.mountpoint
        assert sorted(os.listdir(os.path.join(mnt, "d"))) == want_d
        assert "win\\dir" in os.listdir(mnt)
        for rel, data in files.items():  # warm now: hits from the cache disk
            with open(os.path.join(mnt, rel), "rb") as f:
                assert f.read() == data, rel
    finally:
        mount.stop()


def test_a_path_with_a_nul_byte_is_refused_by_name(tmp_path, key_file):
    root, _, _ = _local_source(tmp_path, {"a.bin": b"a"})
    with Volume("odd", root, str(key_file), socket_path=str(tmp_path / "none.sock")) as vol:
        with pytest.raises(OSError, match="NUL byte"):
            vol.read("a\0.bin", 0, 1)


def _find(root: str) -> list[str]:
    out = subprocess.run(["find", ".", "-printf", r"%y %s %p\n"], cwd=root, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return sorted(out.splitlines())


def test_find_over_a_mount_equals_the_source(tmp_path, key_file, daemon):
    root = tmp_path / "remote"
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "five.bin").write_bytes(b"x" * 5000)
    (root / "dir" / "sub" / "empty").write_bytes(b"")
    os.symlink("dir/five.bin", root / "link-to-file")          # 12 bytes of target
    os.symlink("dir/sub", root / "link-to-dir")
    os.symlink("missing/target/name", root / "dangling")
    os.symlink("../five.bin", root / "dir" / "sub" / "up")
    mount = FsclientMount(str(root), str(tmp_path / "mnt"), str(key_file), daemon.socket_path,
                          volume="odd", args=["--block-size", str(BS)],
                          log_path=str(tmp_path / "mnt.log"))
    try:
        mount.start()
        want = _find(str(root))
        assert "l 12 ./link-to-file" in want
        assert _find(mount.mountpoint) == want
        assert os.readlink(os.path.join(mount.mountpoint, "link-to-file")) == "dir/five.bin"
        with open(os.path.join(mount.mountpoint, "link-to-file"), "rb") as f:
            assert f.read() == b"x" * 5000  # the kernel follows it, as on the source
    finally:
        mount.stop()
