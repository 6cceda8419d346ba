"""Read-ahead stops with its reader and stays in the memory budget: a file closed, or
sought elsewhere, drops its fetches not yet sent; 8 sequential readers at once
hold no more than `memory_cache_bytes`, and leave nothing running."""

from __future__ import annotations

import random
import threading
import time

from blockcache_client import Volume
from blockcache_client.reader.ahead import prefetch
from tests.support.waiting import wait_for

BS = 1 << 20
DELAY = 0.5               # every source request waits this long


def _slow_volume(local_source, key_file, tmp_path) -> tuple[Volume, list[str]]:
    vol = Volume("ahead", f"latency::file://{local_source.root}", key_file,
                 socket_path=str(tmp_path / "no-daemon.sock"), block_size=BS,
                 memory_cache_bytes=8 * BS, meta_ttl=3600, latency={"delay": DELAY})
    calls: list[str] = []
    vol.backend.observe = lambda what, seconds, exc: calls.append(what)
    return vol, calls


def _queue_read_ahead(vol, local_source, calls) -> tuple:
    """A file read 3 MiB front to back (window: 4 blocks), its third read
    sending the next window ahead while every pool thread waits on the
    source for another file: that job is queued. Returns (the file, the
    source reads made so far)."""
    for name in ("f.bin", "busy.bin"):
        local_source.write(name, random.Random(name).randbytes(prefetch.WORKERS * 4 * BS))
    vol.listdir("")
    f = vol.open("f.bin")
    assert len(f.read(BS)) == BS  # a miss: blocks 0-3 in one request
    assert len(f.read(BS)) == BS
    before = len(calls)
    busy = vol.stat("busy.bin")  # from the listing: no request
    vol.prefetch("busy.bin", 0, busy.size, info=busy)  # a window job per pool thread
    assert len(f.read(BS)) == BS  # half way through the window: blocks 4-7 ahead
    return f, before


def _source_reads(vol, before: int, calls: list[str]) -> int:
    """Once no read-ahead runs: the source reads made since `before`."""
    wait_for(lambda: vol._prefetcher._pending == 0, timeout=10 * DELAY + 10,
             what="the read-ahead pool to drain")
    return sum(1 for c in calls[before:] if c == "read")


def test_close_cancels_read_ahead(local_source, key_file, tmp_path):
    vol, calls = _slow_volume(local_source, key_file, tmp_path)
    with vol:
        f, before = _queue_read_ahead(vol, local_source, calls)
        f.close()
        assert _source_reads(vol, before, calls) == prefetch.WORKERS  # busy.bin's only
        assert vol.stats()["prefetches_cancelled"] == 1


def test_seek_cancels_read_ahead(local_source, key_file, tmp_path):
    vol, calls = _slow_volume(local_source, key_file, tmp_path)
    with vol:
        f, before = _queue_read_ahead(vol, local_source, calls)
        f.seek(0)
        assert _source_reads(vol, before, calls) == prefetch.WORKERS
        assert vol.stats()["prefetches_cancelled"] == 1
        f.seek(0)  # no move: nothing to cancel
        assert f.read(BS) == random.Random("f.bin").randbytes(BS)


def test_a_reader_that_keeps_reading_keeps_its_read_ahead(local_source, key_file, tmp_path):
    """The control: without a close or seek the window sent ahead is fetched."""
    vol, calls = _slow_volume(local_source, key_file, tmp_path)
    with vol:
        f, before = _queue_read_ahead(vol, local_source, calls)
        assert _source_reads(vol, before, calls) == prefetch.WORKERS + 1
        assert vol.stats()["prefetches_cancelled"] == 0
        f.close()


def _eight_readers(vol, datas: list[bytes]) -> int:
    """Read the 8 files front to back at once; the most memory seen held."""
    peak = [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], vol.stats()["memory_bytes"])
            time.sleep(0.001)

    def read(i: int) -> None:
        got = bytearray()
        with vol.open(f"s{i}.bin") as f:
            while chunk := f.read(BS):
                got += chunk
        assert got == datas[i], i

    watcher = threading.Thread(target=watch)
    watcher.start()
    readers = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(60)
    done.set()
    watcher.join()
    assert not any(t.is_alive() for t in readers)
    return peak[0]


def test_eight_sequential_readers_stay_in_the_memory_budget(local_source, key_file, daemon):
    budget = 12 * BS
    datas = [random.Random(40 + i).randbytes(10 * BS + 999) for i in range(8)]
    for i, data in enumerate(datas):
        local_source.write(f"s{i}.bin", data)
    for epoch in ("cold", "warm"):
        with Volume("mem", local_source.url, key_file, socket_path=daemon.socket_path,
                    block_size=BS, memory_cache_bytes=budget) as vol:
            wait_for(lambda vol=vol: vol.stats()["daemon_connected"], what="the daemon link")
            peak = _eight_readers(vol, datas)
            assert peak <= budget, (epoch, peak)
            if epoch == "cold":  # fetched blocks pass through memory (warm: the disk)
                assert peak > 0
            else:  # hits read and decrypt unit by unit: a buffer per thread, no more
                s = vol.stats()
                unit = vol._hits.decrypt.unit_bytes
                assert 0 < s["decrypt_buffer_bytes"] <= (s["decrypt_threads"] - 1 + 8) * unit
            wait_for(lambda vol=vol: vol._prefetcher._pending == 0, what="read-ahead to end")
            assert vol.wait_fills(20)
            daemon.wait_idle()


def test_a_cold_window_comes_in_parallel_parts(local_source, key_file, tmp_path):
    """A sequential miss waits for the window's first part (8 MiB); its other
    parts are fetched at once, in parallel, not after it."""
    import fsspec

    data = random.Random(50).randbytes(32 * BS)
    local_source.write("w.bin", data)
    fs = fsspec.filesystem("latency", target_protocol="file", delay=DELAY)
    with Volume("parts", local_source.root, key_file, fs=fs,
                socket_path=str(tmp_path / "no-daemon.sock"), block_size=BS,
                memory_cache_bytes=64 * BS) as vol:  # a window of 32 blocks
        with vol.open("w.bin") as f:
            assert f.read(BS) == data[:BS]
            wait_for(lambda: vol.stats()["prefetches"] >= 31, timeout=10 * DELAY + 10,
                     what="the window's other parts")
            assert f.read() == data[BS:]
        assert fs.max_in_flight >= 3, fs.max_in_flight  # parts 2-4 together
        s = vol.stats()
        assert s["backend_bytes"] == len(data) and s["misses"] == 1
