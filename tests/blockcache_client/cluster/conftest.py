"""Fixtures for the cluster tier: real memcached servers on loopback ports and
hosts (one `blockcached` each, with its own cache dir and socket) that hand
the pool to their readers in `hello`. Everything started is stopped."""

from __future__ import annotations

import contextlib
import os

import pytest

from blockcache_client import Volume
from devtools.daemon import DaemonProcess
from devtools.memcached import MemcachedProcess
from tests.support.waiting import wait_for

# what tests give the readers: small timeouts keep a stalled server's cost low
FAST = {"connect_timeout": "50ms", "timeout": "100ms", "retry_after": "1s"}


def cluster_toml(servers: list[str], **keys: str) -> str:
    lines = ["[cluster]", "memcached = [" + ", ".join(f'"{s}"' for s in servers) + "]"]
    lines += [f'{k} = "{v}"' for k, v in {**FAST, **keys}.items()]
    return "\n".join(lines) + "\n"


class Cluster:
    """memcached servers and hosts started for one test; `close` stops all."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.servers: list[MemcachedProcess] = []
        self.hosts: list[DaemonProcess] = []
        self.volumes: list[Volume] = []

    def memcached(self, n: int = 1, memory_mb: int = 64, extra: tuple[str, ...] = ()):
        started = [MemcachedProcess(memory_mb, extra_args=extra) for _ in range(n)]
        for m in started:
            self.servers.append(m)
            m.start()
        return started

    def host(self, servers: list[str] | None = None, **keys: str) -> DaemonProcess:
        """A daemon pointed at `servers` (default: every memcached started)."""
        i = len(self.hosts)
        home = self.tmp_path / f"host{i}"
        home.mkdir()
        servers = [m.address for m in self.servers] if servers is None else servers
        conf = home / "blockcached.toml"
        conf.write_text(cluster_toml(servers, **keys))
        d = DaemonProcess(home, extra_args=["--config", str(conf)])
        self.hosts.append(d)
        d.start()
        return d

    def volume(self, host: DaemonProcess, source: str, key_file: str, name: str = "ds",
               **kw) -> Volume:
        v = Volume(name, source, key_file, socket_path=host.socket_path, **kw)
        self.volumes.append(v)
        # the link learns the tier's pool in its hello: a read before it goes to
        # the source (as it should), which a test of tier reads would count
        wait_for(lambda: v.stats()["daemon_connected"], what="the daemon link")
        return v

    def close(self) -> None:
        for v in self.volumes:
            with contextlib.suppress(Exception):
                v.close()
        for d in self.hosts:
            with contextlib.suppress(Exception):
                d.stop()
        for m in self.servers:
            with contextlib.suppress(Exception):
                m.stop()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def dataset(tmp_path):
    """A local source dir with files of several shapes; returns (root, {rel: bytes})."""
    root = tmp_path / "remote"
    root.mkdir()
    files = {
        "small.bin": os.urandom(100_000),
        "one-block.bin": os.urandom(1 << 20),
        "big.bin": os.urandom((4 << 20) * 2 + 12345),
    }
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    return str(root), files
