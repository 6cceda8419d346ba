"""Many readers, one fetch, through FUSE: processes on two mounts of one
volume (two pods of a node) read one cold file at once; the S3 server
(moto, behind a front that counts what it serves) sends each block once,
and every reader gets every byte."""

from __future__ import annotations

import hashlib
import os

import pytest

from devtools.daemon import DaemonProcess
from tests.support.fsclient_mounts import FsclientMount, s3_config
from tests.support.leasereaders import Readers
from tests.support.s3front import S3Front

pytestmark = pytest.mark.fuse

BS = 1 << 20
SIZE = 24 * BS + 4321


def _mount(tmp_path, name: str, s3, front: S3Front, key_file, d: DaemonProcess):
    config = s3_config(tmp_path / f"{name}.toml", s3, front.url)
    return FsclientMount(s3.url("models"), str(tmp_path / name), str(key_file), d.socket_path,
                         volume="leased", args=["--block-size", str(BS), *config],
                         log_path=str(tmp_path / f"{name}.log"))


@pytest.mark.parametrize("per_mount", [2, 4])
def test_readers_on_two_mounts_fetch_each_block_of_a_cold_file_once(tmp_path, s3, key_file,
                                                                    per_mount):
    data = os.urandom(SIZE)
    s3.filesystem().pipe(f"{s3.bucket}/models/ckpt.bin", data)
    d = DaemonProcess(tmp_path, extra_args=["--lease-timeout", "30"]).start()
    mounts = []
    try:
        with S3Front(s3.endpoint_url) as front:
            for name in ("pod-a", "pod-b"):
                mounts.append(_mount(tmp_path, name, s3, front, key_file, d))
                mounts[-1].start()
            with Readers() as rs:
                for m in mounts:
                    for _ in range(per_mount):
                        rs.path(os.path.join(m.mountpoint, "ckpt.bin"))
                rs.wait_ready()
                rs.go()
                got = rs.results(timeout=90)
            served = front.body_bytes(f"{s3.bucket}/models/ckpt.bin")
        assert [r["sha"] for r in got] == [hashlib.sha256(data).hexdigest()] * 2 * per_mount
        assert served == SIZE, served / SIZE  # each block once, whichever mount asked
        stats = [m.stats() for m in mounts]
        blocks = -(-SIZE // BS)
        assert sum(s["leases_taken"] for s in stats) == blocks
        assert sum(s["backend_bytes"] for s in stats) == SIZE
        le = d.client().stats()["leases"]
        assert le["taken"] == blocks and le["saved"] >= 1
        assert le["expired"] == le["lost"] == le["declined"] == 0
    finally:
        for m in reversed(mounts):
            m.stop()
        d.stop()
