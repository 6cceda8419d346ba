"""Reading a process's Prometheus endpoint: the port it logged, and its samples."""

from __future__ import annotations

import re
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} from a /metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def logged_port(read_log, pattern: str = r"serving metrics on http://[^:]+:(\d+)/metrics",
                timeout: float = 20.0) -> int:
    """The port a process logged it serves metrics on (it binds port 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, read_log())
        if m:
            return int(m.group(1))
        time.sleep(0.05)
    raise AssertionError(f"no metrics address in the log:\n{read_log()}")
