"""The remote fails mid-epoch: the S3 server (moto) is stopped while a
`Volume` and a FUSE mount are reading, then brought back on the same port.

What must hold: cached blocks keep being served (correct bytes) while the
remote is gone; an uncached read fails once the retry budget is spent
(through FUSE always EIO; `Volume` raises EIO, or ETIMEDOUT when the last
attempt timed out), never hangs; reads of
those blocks work again when the remote returns.
"""

from __future__ import annotations

import errno
import os
import time

import pytest

from blockcache_client import Volume
from devtools.s3server import S3Server
from tests.support.figures import record
from tests.support.fsclient_mounts import FsclientMount
from tests.support.skips import needs_fuse
from tests.support.volumes import BS
from tests.support.waiting import wait_for

pytestmark = needs_fuse

TIMEOUT, ATTEMPTS = 1.0, 2    # the backend's per-call timeout and attempts
BUDGET = 60.0                 # "does not hang": far above timeout * attempts + backoff


def _upload(server: S3Server, files: dict[str, bytes]) -> None:
    fs = server.filesystem()
    for rel, data in files.items():
        fs.pipe(f"{server.bucket}/ds/{rel}", data)


def _toml(server: S3Server) -> str:
    o = server.storage_options
    return (f'memory_cache_bytes = 0\nmeta_ttl = 3600\n[storage_options]\n'
            f'endpoint_url = "{o["endpoint_url"]}"\nkey = "{o["key"]}"\n'
            f'secret = "{o["secret"]}"\ntimeout = {TIMEOUT}\nattempts = {ATTEMPTS}\n'
            f'[storage_options.client_kwargs]\nregion_name = "us-east-1"\n')


def _fuse_read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_remote_stopped_mid_epoch(tmp_path, key_file, daemon):
    files = {f"f{i}.bin": os.urandom(BS + 1000 * i) for i in range(6)}
    cached, uncached = sorted(files)[:3], sorted(files)[3:]
    s3 = S3Server().start()
    back: S3Server | None = None
    vol = None
    cfg = tmp_path / "mount.toml"
    cfg.write_text(_toml(s3))
    mount = FsclientMount(s3.url("ds"), str(tmp_path / "mnt"), key_file, daemon.socket_path,
                          volume="vol", args=["--block-size", str(BS), "--config", str(cfg)],
                          log_path=str(tmp_path / "mnt.log"))
    try:
        _upload(s3, files)
        vol = Volume("vol", s3.url("ds"), key_file, socket_path=daemon.socket_path,
                     block_size=BS, memory_cache_bytes=0, meta_ttl=3600, timeout=TIMEOUT,
                     attempts=ATTEMPTS, **s3.storage_options)
        mount.start()
        wait_for(lambda: vol.stats()["daemon_connected"], what="the volume to connect")
        # the epoch so far: the whole dataset listed, part of it read (and cached)
        vol.listdir("")
        assert sorted(os.listdir(mount.mountpoint)) == sorted(files)
        for rel in files:
            os.stat(os.path.join(mount.mountpoint, rel))
        for rel in cached:
            assert vol.read(rel, 0, len(files[rel])) == files[rel]
        assert vol.wait_fills(10)
        daemon.wait_idle()

        s3.stop()  # the remote is gone

        served = 0
        for rel in cached:  # both readers keep getting cached data
            assert vol.read(rel, 0, len(files[rel])) == files[rel]
            assert _fuse_read(os.path.join(mount.mountpoint, rel)) == files[rel]
            served += 2
        took, codes = {}, {}
        for who in ("volume", "fuse"):
            rel = uncached[0] if who == "volume" else uncached[1]
            t0 = time.monotonic()
            with pytest.raises(OSError) as exc:
                if who == "volume":
                    vol.read(rel, 0, BS)
                else:
                    _fuse_read(os.path.join(mount.mountpoint, rel))
            took[who] = time.monotonic() - t0
            # Volume: EIO, or ETIMEDOUT when the last attempt ran out of time
            # (s3fs and botocore retry a refused connection inside one
            # attempt); the mount maps every remote failure to EIO
            allowed = (errno.EIO, errno.ETIMEDOUT) if who == "volume" else (errno.EIO,)
            assert exc.value.errno in allowed, (who, exc.value)
            codes[who] = errno.errorcode[exc.value.errno]
            assert took[who] < BUDGET
        assert vol.stats()["hits"] >= len(cached)

        back = S3Server(port=s3.port).start()  # same address; its objects restored
        _upload(back, files)

        def resumed() -> bool:
            try:
                return (vol.read(uncached[0], 0, len(files[uncached[0]])) == files[uncached[0]]
                        and _fuse_read(os.path.join(mount.mountpoint, uncached[1]))
                        == files[uncached[1]])
            except OSError:
                return False
        t0 = time.monotonic()
        wait_for(resumed, 30, "reads to resume once the remote is back")
        resume_s = time.monotonic() - t0
        for rel in files:  # everything, cached or not, reads right again
            assert vol.read(rel, 0, len(files[rel])) == files[rel]
            assert _fuse_read(os.path.join(mount.mountpoint, rel)) == files[rel]
        record("remote_stopped", cached_reads_served=served, wrong_bytes=0,
               error_after_s_volume=round(took["volume"], 2),
               error_after_s_fuse=round(took["fuse"], 2), backend_timeout_s=TIMEOUT,
               attempts=ATTEMPTS, resumed_after_restart_s=round(resume_s, 2),
               errno_volume=codes["volume"], errno_fuse=codes["fuse"])
    finally:
        if vol is not None:
            vol.close()
        mount.stop()
        s3.stop()
        if back is not None:
            back.stop()
