"""The cluster tier's items of a volume's blocks, read straight from
memcached as anyone on the network may: get any items (whatever their
size), set any item, for tests that look inside the tier or poison it.

The shipped client (`cluster.memcache`) reads only values of the sizes it
asked for; `RawMemcache` believes what the server says, so it is for tests only.
"""

from __future__ import annotations

import socket

from blockcache_client.cluster.items import Geometry, item_key
from blockcache_client.cluster.memcache import Memcache
from tests.support.volumes import block_key


class RawMemcache(Memcache):
    """A real memcached on 127.0.0.1:`port`: `set`, `get` and `get_many` of any item."""

    def __init__(self, port: int):
        super().__init__(("127.0.0.1", port), 2.0, 2.0)

    def set(self, name: str, value: bytes) -> None:  # type: ignore[override]
        """Store `value` at `name`, whatever was there."""
        self.delete_many([name])
        assert self.add(name, value)

    def get(self, name: str) -> bytes | None:
        return self.get_many([name]).get(name)

    def get_many(self, names: list[str]) -> dict[str, bytes]:
        """The values of the names the server holds, each as it says."""
        out = {}
        with socket.create_connection(self.address, timeout=5.0) as sock, \
                sock.makefile("rb") as f:
            sock.sendall(b"get " + " ".join(names).encode() + b"\r\n")
            while (line := f.readline()) != b"END\r\n":
                _, name, _, size = line.split()
                out[name.decode()] = f.read(int(size))
                assert f.read(2) == b"\r\n"
        return out


def block_keys(volume, files) -> dict[str, int]:
    """{block key: block length} of every block of `files` in `volume`."""
    out = {}
    for rel in files:
        info = volume.stat(rel)
        for off, length, _ in volume.block_map(rel, info):
            out[block_key(volume, rel, off, info)] = length
    return out


def all_items(servers, keys: dict[str, int]) -> dict[str, bytes]:
    """Every tier item of these blocks that any of the servers holds."""
    names = [item_key(k, i) for k, blen in keys.items()
             for i in range(Geometry(blen, 64 << 10).count)]
    out = {}
    for m in servers:
        raw = RawMemcache(m.port)
        try:
            out.update(raw.get_many(names))
        finally:
            raw.close()
    return out
