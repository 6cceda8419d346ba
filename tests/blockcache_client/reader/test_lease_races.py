"""A thread that joined another thread's fetch which ended "another reader
on the host filled it" (`hostflight`: its leased leader read nothing) and
then finds no hit, fetches the block itself: a read never answers None,
short or empty data (`Fetcher.fetch`, `ReadPath.block`)."""

from __future__ import annotations

import os

from blockcache_client.reader.misses import singleflight
from tests.support.volumes import BS, connected_volume


def test_a_joined_fetch_that_landed_elsewhere_is_fetched_here(
        tmp_path, daemon, key_file, local_source, monkeypatch):
    data = os.urandom(3 * BS)
    local_source.write("f.bin", data)
    joined = []
    real_do = singleflight.SingleFlight.do

    def do(self, key, fn):
        # The first two fetches of each block join a leader whose block
        # landed elsewhere (None), as threads racing another process do;
        # the daemon is told nothing, so the hit after them misses.
        if joined.count(key) < 2:
            joined.append(key)
            return None, False
        return real_do(self, key, fn)

    monkeypatch.setattr(singleflight.SingleFlight, "do", do)
    vol = connected_volume("vol", local_source.url, key_file, daemon)
    try:
        assert vol.read("f.bin", BS + 100, 4096) == data[BS + 100:BS + 4196]
        assert vol.read("f.bin", 0, 3 * BS) == data
    finally:
        vol.close()
    assert len(joined) == 6  # each block's two joins, then a fetch of its own
