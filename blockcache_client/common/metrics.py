"""Prometheus plumbing shared by blockcached and fsclient.

- `serve`: prometheus-client's HTTP endpoint on its own daemon thread, for a
  registry holding our custom collectors; never on an event loop thread, so
  a slow scrape cannot stall request handling.
- `Histogram`: a latency histogram for hot paths. prometheus-client's own
  takes a lock per observation; this one is a list of bucket counts that one
  thread updates (the daemon's event loop) and a collector copies on that
  same thread, or reads racily but monotonically (a scrape may see an
  observation in a bucket before the sum; harmless). `LockedHistogram` is
  the same under a lock, for many threads (fsclient's FUSE workers).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Iterable

from prometheus_client import start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry

from .convert import parse_addr

log = logging.getLogger(__name__)

# seconds: from a memory-answered request (tens of µs) to a slow remote read
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class MetricsServer:
    """The /metrics HTTP endpoint of one registry, on a background thread."""

    def __init__(self, addr: str, registry: CollectorRegistry):
        host, port = parse_addr(addr)
        self._server, self._thread = start_http_server(port, host, registry)
        self.host, self.port = self._server.server_address[:2]
        log.info("serving metrics on http://%s:%d/metrics", self.host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class Histogram:
    """Bucketed observations per label value (bucket i counts values <= bounds[i])."""

    __slots__ = ("bounds", "series")

    def __init__(self, bounds: Iterable[float] = LATENCY_BUCKETS):
        self.bounds = tuple(bounds)
        self.series: dict[str, list] = {}  # label -> [count per bucket..., +Inf count, sum]

    def observe(self, label: str, value: float) -> None:
        s = self.series.get(label)
        if s is None:
            s = self.series[label] = [0] * (len(self.bounds) + 1) + [0.0]
        s[bisect.bisect_left(self.bounds, value)] += 1
        s[-1] += value

    def snapshot(self) -> dict[str, list]:
        return {k: list(v) for k, v in list(self.series.items())}

    def family(self, name: str, doc: str, label: str, snap: dict[str, list] | None = None,
               const: dict[str, str] | None = None) -> HistogramMetricFamily:
        """A Prometheus histogram family from `snap` (default: a snapshot now);
        `const` labels (e.g. the volume) go on every series."""
        const = const or {}
        fam = HistogramMetricFamily(name, doc, labels=[*const, label])
        for value, s in sorted((self.snapshot() if snap is None else snap).items()):
            buckets, acc = [], 0
            for bound, n in zip((*map(str, self.bounds), "+Inf"), s[:-1]):
                acc += n
                buckets.append((bound, acc))
            fam.add_metric([*const.values(), value], buckets, s[-1])
        return fam


class LockedHistogram(Histogram):
    """A `Histogram` that many threads may observe into."""

    __slots__ = ("lock",)

    def __init__(self, bounds: Iterable[float] = LATENCY_BUCKETS):
        super().__init__(bounds)
        self.lock = threading.Lock()

    def observe(self, label: str, value: float) -> None:
        with self.lock:
            Histogram.observe(self, label, value)

    def snapshot(self) -> dict[str, list]:
        with self.lock:
            return Histogram.snapshot(self)
