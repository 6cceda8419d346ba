"""Many threads of one process and a reader in another race on the same
blocks through a real daemon with fetch leases: every read answers the
file's bytes. A thread that joined another thread's fetch which ended
"another reader filled it" reads it there, or fetches it itself: never
None, short or empty data (`Fetcher.fetch`, `ReadPath.block`)."""

from __future__ import annotations

import hashlib
import os
import random
import threading

from devtools.daemon import DaemonProcess
from tests.blockcache_client.conftest import S3Source
from tests.support.leasereaders import Readers
from tests.support.volumes import (
    BS,
    cached_block_path,
    connected_volume,
    damage_block,
    settle,
)

BLOCKS = 24
THREADS = 8


def _race(vol, src: S3Source, key_file: str, d: DaemonProcess, data: bytes,
          seed: int) -> list[str]:
    """THREADS threads here and a `Volume` in another process read every
    block of f.bin at once; what the threads got wrong."""
    wrong: list[str] = []
    go = threading.Event()

    def reader(n: int) -> None:
        rnd = random.Random(seed * 100 + n)
        order = list(range(BLOCKS))
        rnd.shuffle(order)
        go.wait(30)
        for b in order:
            off = b * BS + (rnd.randrange(BS - 4096) if n % 2 else 0)
            size = 4096 if n % 2 else BS
            try:
                got = vol.read("f.bin", off, size)
            except Exception as exc:  # noqa: BLE001 - reported with the others
                got = exc
            if got != data[off:off + size]:
                shown = got if not isinstance(got, bytes) else f"{len(got)} bytes, not these"
                wrong.append(f"thread {n} block {b} at {off}: {shown!r}")

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    with Readers() as rs:
        rs.volume("vol", src.url, key_file, d.socket_path, dict(src.options), "f.bin", BS)
        rs.wait_ready()
        rs.go()
        go.set()
        (other,) = rs.results(timeout=60)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a reading thread hung"
    assert other["sha"] == hashlib.sha256(data).hexdigest()
    return wrong


def test_threads_and_another_process_racing_on_cold_then_bad_blocks_read_their_bytes(
        tmp_path, s3_server, key_file):
    src = S3Source(s3_server)
    data = os.urandom(BLOCKS * BS)
    src.write("f.bin", data)
    # a cache of a third of the file: blocks are evicted soon after they land,
    # so a reader told "filled" may find its block gone again
    d = DaemonProcess(tmp_path, cache_dirs=[(tmp_path / "cache", str(BLOCKS * BS // 3))],
                      extra_args=["--lease-timeout", "30"]).start()
    try:
        # no memory LRU: every read asks the cache disk, then the leases
        vol = connected_volume("vol", src.url, key_file, d, memory_cache_bytes=0,
                               **src.options)
        try:
            assert _race(vol, src, key_file, d, data, 1) == []  # cold: each block leased
            settle(vol, d)
            # every cached block bad: the daemon indexes each until its eviction,
            # so a refill's lease is answered "cached" meanwhile
            for b in range(BLOCKS):
                path = cached_block_path(vol, d, "f.bin", b * BS)[1]
                if os.path.exists(path):  # (those not evicted yet)
                    damage_block(path, "body")
            assert _race(vol, src, key_file, d, data, 2) == []
        finally:
            vol.close()
    finally:
        d.stop()
