"""The daemon's Prometheus endpoint: parses, and moves with real requests."""

from __future__ import annotations

import socket

import pytest

from blockcache_client.contract import blockfile
from blockcache_client.contract.blockkey import BlockKey
from devtools.daemon import DaemonProcess
from tests.support.cli_runs import run_cli
from tests.support.metrics import logged_port, scrape, value

VOLUME_KEY = bytes(range(32))


def block(vol: str, off: int, size: int = 10_000) -> tuple[str, bytes]:
    key = str(BlockKey(vol, 42, 7, off))
    return key, blockfile.seal(key, bytes(size), VOLUME_KEY)


@pytest.fixture
def metered(tmp_path):
    d = DaemonProcess(tmp_path, extra_args=["--metrics-addr", "127.0.0.1:0"])
    try:
        d.start()
        d.wait_rebuilt()
        yield d, logged_port(d.stderr)
    finally:
        d.stop()


def test_daemon_metrics_parse_and_count_requests(metered):
    d, port = metered
    before = scrape(port)
    assert value(before, "blockcache_up") == 1
    assert value(before, "blockcache_entries") == 0
    assert value(before, "blockcache_capacity_bytes") == 1 << 30

    c = d.client()
    blobs = [block("alpha", i * 4096) for i in range(3)] + [block("beta", 0)]
    for key, blob in blobs:
        assert c.put(key, blob) == (True, "queued")
    d.wait_idle()
    c.touch([blobs[0][0], blobs[1][0]])
    c.lookup([blobs[3][0], str(BlockKey("beta", 42, 7, 8192))])
    c.put(*blobs[0])  # exists

    s = c.stats()
    after = scrape(port)
    size = len(blobs[0][1])
    assert value(after, "blockcache_entries") == 4 == s["entries"]
    assert value(after, "blockcache_used_bytes") == 4 * size
    assert value(after, "blockcache_hits_total", via="touch") == 2
    assert value(after, "blockcache_hits_total", via="lookup") == 1
    assert value(after, "blockcache_misses_total", via="lookup") == 1
    assert value(after, "blockcache_misses_total", via="put") == 5
    assert value(after, "blockcache_hit_bytes_total") == 2 * size
    assert value(after, "blockcache_put_bytes_total") == 5 * size
    assert value(after, "blockcache_puts_total", result="queued") == 4
    assert value(after, "blockcache_puts_total", result="exists") == 1
    assert value(after, "blockcache_volume_entries", volume="alpha") == 3
    assert value(after, "blockcache_volume_used_bytes", volume="beta") == size
    assert value(after, "blockcache_volume_hits_total", volume="alpha") == 2
    assert value(after, "blockcache_volume_puts_total", volume="alpha") == 4
    assert value(after, "blockcache_connections") >= 1
    assert value(after, "blockcache_rebuild_running") == 0
    assert value(after, "blockcache_request_seconds_count", op="put") == 5
    assert value(after, "blockcache_request_seconds_bucket", op="put", le="+Inf") == 5
    [cache_dir] = d.cache_dirs
    assert value(after, "blockcache_dir_healthy", dir=cache_dir) == 1
    assert value(after, "blockcache_dir_used_bytes", dir=cache_dir) == 4 * size
    assert value(after, "blockcache_dir_high_watermark_bytes", dir=cache_dir) == \
        pytest.approx(0.98 * value(after, "blockcache_dir_limit_bytes", dir=cache_dir))


def test_capacity_evictions_show_in_metrics(tmp_path):
    # plain LRU: every put is admitted, so 12 of them must evict
    d = DaemonProcess(tmp_path, cache_dirs=[(tmp_path / "small", "64K")],
                      extra_args=["--metrics-addr", "127.0.0.1:0", "--admission-policy", "lru"])
    try:
        d.start()
        d.wait_rebuilt()
        port = logged_port(d.stderr)
        c = d.client()
        for i in range(12):  # 12 x 10 KB into 64 KiB: LRU eviction must run
            c.put(*block("gamma", i * 4096))
            d.wait_idle()
        s = c.stats()
        m = scrape(port)
        assert s["evictions"] > 0
        assert value(m, "blockcache_evictions_total") == s["evictions"]
        assert value(m, "blockcache_evicted_bytes_total") == s["evicted_bytes"]
        assert value(m, "blockcache_used_bytes") <= value(
            m, "blockcache_dir_high_watermark_bytes", dir=d.cache_dirs[0])
    finally:
        d.stop()


def test_metrics_are_off_by_default(daemon):
    assert "serving metrics" not in daemon.stderr()


def test_bad_metrics_addr_is_refused_at_start(tmp_path):
    bad = run_cli("blockcached", "--socket", str(tmp_path / "s.sock"), "--cache-dir",
                  f"{tmp_path / 'c'}:1G", "--metrics-addr", "localhost")
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr, bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        busy = run_cli("blockcached", "--socket", str(tmp_path / "s.sock"), "--cache-dir",
                       f"{tmp_path / 'c'}:1G", "--min-free-bytes", "0",
                       "--metrics-addr", f"127.0.0.1:{port}")
    assert busy.returncode == 1 and "cannot serve" in busy.stderr, busy.stderr
