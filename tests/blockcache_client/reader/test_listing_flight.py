"""Concurrent identical listings are one request (reader.misses.metadata's single-flight):
many threads stat-ing a cold directory at once list it once, and each gets its answer."""

from __future__ import annotations

import threading

from blockcache_client import Volume


def _calls(vol) -> list[str]:
    calls: list[str] = []
    vol.backend.observe = lambda what, seconds, exc: calls.append(what)
    return calls


def test_64_threads_stat_a_cold_directory_with_one_listing(tmp_path, key_file):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(64):
        (src / "d" / f"f{i:02d}").write_bytes(b"x" * i)
    # every request waits 50 ms, so the threads' listings would overlap
    with Volume("flight", f"latency::file://{src}", key_file, socket_path=str(tmp_path / "no"),
                meta_ttl=3600, latency={"delay": 0.05}) as vol:
        calls = _calls(vol)
        vol.stat("d/f00")  # the directory's first stat: one request, then listings
        start = threading.Barrier(64)
        sizes: dict[int, int] = {}

        def stat(i: int) -> None:
            start.wait()
            sizes[i] = vol.stat(f"d/f{i:02d}").size

        threads = [threading.Thread(target=stat, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sizes == {i: i for i in range(64)}
        assert calls.count("list") == 1, calls


def test_a_fresh_listing_never_joins_one_running(tmp_path, key_file):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a").write_bytes(b"a")
    with Volume("flight", f"latency::file://{src}", key_file, socket_path=str(tmp_path / "no"),
                meta_ttl=3600, latency={"delay": 0.2}) as vol:
        calls = _calls(vol)
        slow = threading.Thread(target=vol.listdir, args=("d",))
        slow.start()
        (src / "d" / "b").write_bytes(b"b")  # may be missed by the listing running
        names = [i.name for i in vol.listdir("d", max_age=0)]
        slow.join(10)
        assert names == ["a", "b"]
        assert calls.count("list") == 2
