"""The cluster tier's items of a volume's blocks, read straight from memcached."""

from __future__ import annotations

from blockcache_client.cluster.items import Geometry, item_key
from blockcache_client.cluster.memcache import Memcache
from tests.support.volumes import block_key


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
        raw = Memcache(("127.0.0.1", m.port), 2.0, 2.0)
        try:
            out.update(raw.get_many(names))
        finally:
            raw.close()
    return out
