"""The cluster tier seen from outside: `Volume.stats()`, the daemon's `stats`
under `cluster`, `blockcache-cli stats`, Prometheus; and a FUSE mount (the
same reader) served from the tier."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.procs import free_port
from tests.support.cli_runs import run_cli
from tests.support.fsclient_mounts import FsclientMount


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_daemon_stats_cli_and_prometheus_show_what_readers_report(cluster, key_file,
                                                                   dataset):
    root, files = dataset
    cluster.memcached(2)
    port = free_port()
    h1 = cluster.host()
    h2 = cluster.host()
    h2.stop()
    h2.extra_args += ["--metrics-addr", f"127.0.0.1:{port}"]
    h2.start()
    v1 = cluster.volume(h1, root, key_file)
    for rel, data in files.items():
        assert v1.read(rel, 0, len(data)) == data
    assert v1.wait_fills(10)
    v1.close()  # a closing reader reports its last counts
    v2 = cluster.volume(h2, root, key_file)
    for rel, data in files.items():
        assert v2.read(rel, 0, len(data)) == data
    mine = v2.stats()
    assert mine["cluster_hits"] == 5 and mine["cluster_misses"] == 0 and mine["cluster_bytes"] > 0
    v2.close()

    c1 = h1.client().stats()["cluster"]
    assert c1["enabled"] and c1["volumes"]["ds"]["fills_sent"] == 5
    assert c1["volumes"]["ds"]["misses"] == 5
    c2 = h2.client().stats()["cluster"]
    assert c2["memcached"] == [m.address for m in cluster.servers]
    assert c2["volumes"]["ds"] == {"hits": 5, "misses": 0, "bytes": mine["cluster_bytes"],
                                   "errors": 0, "bad": 0, "fills_sent": 0, "fills_dropped": 0}
    assert c2["hits"] == 5 and c2["reports_ignored"] == 0

    out = run_cli("blockcache_client.cli", "--socket", h2.socket_path, "stats")
    assert out.returncode == 0, out.stderr
    assert "cluster      memcached " + ", ".join(c2["memcached"]) in out.stdout
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("CLUSTER VOLUME"))
    assert lines[header + 1].split()[:3] == ["ds", "5", "0"]
    js = json.loads(run_cli("blockcache_client.cli", "--socket", h2.socket_path, "stats",
                            "--json").stdout)
    assert js["cluster"]["volumes"]["ds"]["hits"] == 5

    samples = _scrape(port)
    assert samples[("blockcache_cluster_hits_total", (("volume", "ds"),))] == 5
    assert samples[("blockcache_cluster_bytes_total", (("volume", "ds"),))] == mine["cluster_bytes"]
    # the hits were handed to the daemon, after the first through a fill area
    areas = h2.client().stats()["fill_areas"]
    assert samples[("blockcache_fill_areas_opened_total", ())] == areas["opened"] == 1
    assert samples[("blockcache_fill_area_puts_total", ())] == areas["puts"]


def test_a_report_for_a_volume_the_peer_may_not_use_is_ignored(cluster):
    cluster.memcached(1)
    host = cluster.host()
    c = host.client()
    assert c.ping({"volume": "../etc", "counters": {"cluster_hits": 1}})["layout_epoch"]
    assert c.ping({"volume": "ds", "counters": {"cluster_hits": -5}})
    assert c.touch([], {"volume": "ds", "counters": "many"})
    stats = c.stats()["cluster"]
    assert stats["reports_ignored"] == 3 and stats["volumes"] == {}


@pytest.mark.fuse
def test_a_fuse_mount_reads_from_the_tier(cluster, key_file, dataset, tmp_path):
    root, files = dataset
    cluster.memcached(2)
    v1 = cluster.volume(cluster.host(), root, key_file, name="testvol")
    for rel, data in files.items():
        assert v1.read(rel, 0, len(data)) == data
    assert v1.wait_fills(10)
    h2 = cluster.host()
    mnt = FsclientMount(root, str(tmp_path / "mnt"), key_file, h2.socket_path)
    try:
        mnt.start()
        for rel, data in files.items():
            with open(os.path.join(mnt.mountpoint, rel), "rb") as f:
                assert f.read() == data
        s = mnt.stats()
        assert s["cluster_hits"] >= 5 and s["backend_bytes"] == 0
    finally:
        mnt.stop()
