"""daemonset/grafana-dashboard.json queries only metrics a real daemon and a real
mount export (a renamed metric would leave a panel silently empty)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.daemon import DaemonProcess
from tests.support.cli_runs import BLOCK, VOLUME
from tests.support.fsclient_mounts import REPO, FsclientMount
from tests.support.metrics import logged_port

DASHBOARD = Path(REPO) / "daemonset" / "grafana-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
            "gauge": ("",), "unknown": ("",)}


def exported(port: int) -> set[str]:
    """Every series name the endpoint can produce, samples present or not yet."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    names = set()
    for fam in text_string_to_metric_families(text):
        names.update(fam.name + s for s in SUFFIXES.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def test_dashboard_is_well_formed():
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in d["panels"] if p["type"] != "row"]
    titles = " ".join(p["title"].lower() for p in graphs)
    for topic in ("hit ratio by count", "hit ratio by bytes", "throughput", "watermarks",
                  "dropped", "errors", "health"):
        assert topic in titles, topic
    for p in graphs:
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]


@pytest.mark.fuse
def test_dashboard_queries_exported_metrics(tmp_path, tree, key_file):
    root, files = tree
    d = DaemonProcess(tmp_path, extra_args=["--metrics-addr", "127.0.0.1:0"])
    m = FsclientMount(root, tmp_path / "mnt", key_file, str(tmp_path / "blockcached.sock"),
                      volume=VOLUME, log_path=str(tmp_path / "mnt.log"),
                      args=["--block-size", str(BLOCK), "--metrics-addr", "127.0.0.1:0"])
    used = set(re.findall(r"\b(?:blockcache|process)_[a-z_]+",
                          " ".join(t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
                                   for t in p.get("targets", []))))
    try:
        d.start()
        d.wait_rebuilt()
        m.start()
        with open(Path(m.mountpoint) / "dir0" / "f6.bin", "rb") as f:
            f.read()
        # the daemon's per-volume series appear with the volume's first put,
        # which the mount sends in the background after the read returned
        deadline = time.monotonic() + 10
        while True:
            names = exported(logged_port(d.stderr)) | exported(logged_port(m.log))
            if not used - names or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        m.stop()
        d.stop()
    assert used and not used - names, sorted(used - names)
