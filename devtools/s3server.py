"""A real S3-protocol server on loopback for tests and benchmarks: moto's server mode.

    with S3Server() as s3:              # a moto_server subprocess on 127.0.0.1
        fs = s3.filesystem()            # an s3fs filesystem pointed at it
        fs.pipe(f"{s3.bucket}/a.txt", b"hello")
        Volume("v", s3.url(), key_file, **s3.storage_options)

Start picks a free port, spawns `python -m moto.server`, waits until it
answers HTTP and creates the bucket; stop terminates it (then kills it) so
nothing is left running even when a test fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from devtools.procs import free_port, stop_process

START_TIMEOUT = 30.0
BUCKET = "data"


class S3Server:
    """One moto S3 server subprocess with one bucket."""

    def __init__(self, bucket: str = BUCKET, port: int = 0,
                 env: dict[str, str] | None = None, log_path: str | None = None,
                 module: str = "moto.server"):
        """`port` 0 picks a free port at start; a fixed one lets a test bring a
        stopped server back where its clients expect it (its objects are gone:
        moto keeps them in memory). `env` is added to the server's
        environment; `log_path` keeps its request log in that file; `module`
        runs in place of moto.server with its arguments (a patched moto)."""
        self.bucket = bucket
        self._module = module
        self._env = env or {}
        self._log_path = log_path
        self._fixed_port = port
        self.port = port
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        """fsspec/s3fs options for this server (fake credentials, path-style)."""
        return {"endpoint_url": self.endpoint_url, "key": "testing", "secret": "testing",
                "client_kwargs": {"region_name": "us-east-1"}}

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def filesystem(self):
        """A fresh (uncached) s3fs filesystem on this server."""
        import s3fs
        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                                 **self.storage_options)

    def start(self) -> S3Server:
        self.port = self._fixed_port or free_port()
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                   AWS_DEFAULT_REGION="us-east-1", **self._env)
        # its request log goes to a file: a pipe nobody reads would fill up
        # after a few hundred requests and stall the server
        self._log = open(self._log_path, "ab+") if self._log_path else tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self._module, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=self._log, env=env)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()}")
            try:
                urllib.request.urlopen(self.endpoint_url + "/", timeout=1).close()
                break
            except (urllib.error.URLError, OSError) as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not answer on {self.endpoint_url} "
                                       f"within {START_TIMEOUT:g}s") from exc
                time.sleep(0.1)
        req = urllib.request.Request(f"{self.endpoint_url}/{self.bucket}", method="PUT")
        urllib.request.urlopen(req, timeout=10).close()
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        stop_process(proc)
        self._log.close()

    def log_text(self) -> str:
        """What the server wrote to stderr so far (its request log)."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
