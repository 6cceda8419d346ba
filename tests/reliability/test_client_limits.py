"""What one socket client can take from the others, with a real daemon:
evictions sent during a rebuild, connections, reply bytes, the fill queue,
`list` pages and per-volume state. Each test has a bystander client that
must keep being answered."""

from __future__ import annotations

import os
import threading
import time

from blockcache_client import blockfile, layout
from blockcache_client.client import Client
from blockcache_client.keys import BlockKey
from tests.reliability.conftest import record
from tests.support.daemon import DaemonProcess

# a pause this long means the loop ran one long job: today's matcher list made
# 1.66 s pauses with 5,000 evicts; the set costs milliseconds per 5k chunk
PAUSE_BOUND = 1.0


class PingProbe:
    """A bystander pinging the daemon every 10 ms on its own connection,
    keeping the longest wait for a reply (the event loop's longest pause)."""

    def __init__(self, socket_path: str):
        self.client = Client(socket_path, timeout=30)
        self.worst = 0.0
        self.pings = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            self.client.ping()
            self.worst = max(self.worst, time.monotonic() - t)
            self.pings += 1
            self._stop.wait(0.01)

    def __enter__(self) -> "PingProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()


def _plant_blocks(cache: str, keys: list[str], tmp_junk: int) -> None:
    """Block-sized files under the keys' paths (the scan reads names and
    sizes, not contents), and `tmp_junk` leftover temp files, whose removal
    at start-up keeps the rebuild running while the evictions arrive."""
    blob = b"\0" * (blockfile.HEADER_SIZE + blockfile.TAG_SIZE + 16)
    for k in keys:
        p = os.path.join(cache, layout.block_relpath(k))
        try:
            f = open(p, "wb")
        except FileNotFoundError:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            f = open(p, "wb")
        with f:
            f.write(blob)
    tmp = os.path.join(cache, "tmp")
    os.makedirs(tmp, exist_ok=True)
    for i in range(tmp_junk):
        open(os.path.join(tmp, f"junk.{i}"), "wb").close()


def test_evictions_during_a_rebuild_do_not_freeze_the_loop(tmp_path):
    n_blocks, n_evicts = 20_000, 10_000
    keys = [str(BlockKey("vol", 1000 + i, 0xabc, 0)) for i in range(n_blocks)]
    d = DaemonProcess(tmp_path)
    _plant_blocks(d.cache_dirs[0], keys, tmp_junk=30_000)
    d.start(wait_rebuilt=False)
    try:
        with PingProbe(d.socket_path) as probe:
            c = d.client(timeout=60)
            evicted = keys[::2][:n_evicts]
            replies = []
            for start in range(0, len(evicted), 1000):
                replies += c.pipeline(("evict", {"key": k}) for k in evicted[start:start + 1000])
            during = c.stats()["rebuild"]["state"] == "running"
            # and one inode's blocks by prefix
            c.evict(inode=("vol", 1001))
            s = d.wait_rebuilt(timeout=120)
        assert all(r["ok"] for r in replies)
        assert during, "the rebuild ended before the evictions were sent: plant more tmp junk"
        assert sum(r["evicted"] == 0 for r in replies) == n_evicts  # none was indexed yet
        # each eviction was applied to what the scan found
        left = set(c.list(limit=n_blocks)["keys"])
        want = set(keys[1::2]) - {keys[1]}
        assert not left - want, sorted(left - want)[:5]
        assert left == want, (len(left), len(want), s["rebuild"], s["entries"])
        assert s["entries"] == len(left)
        assert probe.pings > 10
        assert probe.worst < PAUSE_BOUND, f"the loop paused {probe.worst:.2f} s"
        record("evictions_during_rebuild", blocks=n_blocks, evicts=n_evicts,
               worst_ping_s=round(probe.worst, 3), pings=probe.pings,
               rebuild_s=s["rebuild"]["seconds"])
    finally:
        d.stop()
