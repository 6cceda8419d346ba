"""Prometheus metrics of the daemon, read from its stats map (one source of truth).

`DaemonCollector` turns the map that the `stats` op returns (and `blockcache-cli
stats --json` prints) into metric families at scrape time, so nothing is
counted twice and the numbers always agree with the CLI. Scrapes run on
prometheus-client's HTTP thread; the map is built on the event loop (where
every counter changes) by `snapshot_on_loop`, which waits at most
`SNAPSHOT_TIMEOUT`: building it is a few dict copies, so a scrape costs the
loop microseconds, and a stalled loop makes the scrape report
`blockcache_up 0` instead of hanging.

Hits and misses, as the daemon sees them:
- readers (fsclient, `Volume`) find hits through the layout and report them
  with `touch`; after a miss they `put` the block. So `via="touch"` hits and
  `via="put"` misses are the readers' hit/miss counts (by block), and the
  byte counterparts are block-file sizes;
- clients that ask with `lookup` are counted under `via="lookup"`.
A reader does one or the other per block, so summing over `via` double counts
only a client that looks a block up and then puts it (fsclient never does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from blockcache_client.common.metrics import Histogram, MetricsServer

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT = 2.0

Snapshot = tuple[dict[str, Any], dict[str, list]]


def snapshot_on_loop(loop: asyncio.AbstractEventLoop, take: Callable[[], Snapshot],
                     timeout: float = SNAPSHOT_TIMEOUT) -> Callable[[], Snapshot]:
    """A function for other threads that runs `take()` on the loop and returns its result."""
    def snapshot() -> Snapshot:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(take())
                except BaseException as exc:
                    fut.set_exception(exc)
        loop.call_soon_threadsafe(run)
        try:
            return fut.result(timeout)
        finally:
            fut.cancel()  # a late run() then does nothing
    return snapshot


def _c(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    fam = CounterMetricFamily(name, doc, labels=list(labels or ()))
    fam.add_metric(list((labels or {}).values()), value)
    return fam


def _g(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(name, doc, value=value)


class _Labelled:
    """Families with one set of label names, filled row by row."""

    def __init__(self, labels: list[str]):
        self.labels = labels
        self.families: dict[str, Metric] = {}

    def add(self, kind: type, name: str, doc: str, values: list[str], value: float) -> None:
        fam = self.families.get(name)
        if fam is None:
            fam = self.families[name] = kind(name, doc, labels=self.labels)
        fam.add_metric(values, value)


class DaemonCollector(Collector):
    """Metric families from the daemon's stats map and request latencies."""

    def __init__(self, snapshot: Callable[[], Snapshot], latency: Histogram):
        self.snapshot = snapshot
        self.latency = latency

    def describe(self) -> list:
        return []  # families depend on the dirs and volumes present: no pre-registration check

    def collect(self) -> Iterator[Metric]:
        try:
            s, lat = self.snapshot()
        except Exception as exc:  # stalled or stopping loop: say so, don't hang the scrape
            log.warning("metrics scrape: no snapshot from the event loop (%s)", exc or "timeout")
            yield _g("blockcache_up", "1 if the daemon's event loop answered this scrape", 0)
            return
        yield _g("blockcache_up", "1 if the daemon's event loop answered this scrape", 1)
        yield from _totals(s)
        yield from _leases(s.get("leases") or {})
        yield from _dirs(s.get("dirs", []))
        yield from _volumes(s.get("volumes", {}))
        yield from _cluster(s.get("cluster", {}).get("volumes", {}))
        yield self.latency.family("blockcache_request_seconds",
                                  "Time to handle one request, by op (on the event loop)",
                                  "op", lat)


def _totals(s: dict[str, Any]) -> Iterator[Metric]:
    hits = CounterMetricFamily("blockcache_hits_total", "Blocks found in the cache: via=touch "
                               "reported by readers after a hit, via=lookup answered to lookups",
                               labels=["via"])
    hits.add_metric(["touch"], s.get("touches", 0))
    hits.add_metric(["lookup"], s.get("hits", 0))
    yield hits
    misses = CounterMetricFamily("blockcache_misses_total", "Blocks not in the cache: via=put "
                                 "offered by readers after a miss, via=lookup answered to lookups",
                                 labels=["via"])
    misses.add_metric(["put"], s.get("puts", 0))
    misses.add_metric(["lookup"], s.get("misses", 0))
    yield misses
    yield _c("blockcache_hit_bytes_total", "Block-file bytes of the hits readers reported",
             s.get("touch_bytes", 0))
    yield _c("blockcache_put_bytes_total", "Block-file bytes offered by puts",
             s.get("put_bytes", 0))
    puts = CounterMetricFamily("blockcache_puts_total", "Puts by outcome (queued, exists, "
                               "duplicate, queue_full, no_space, ...)", labels=["result"])
    for reason, n in sorted((s.get("put_results") or {}).items()):
        puts.add_metric([reason], n)
    yield puts
    yield _c("blockcache_writes_total", "Blocks written to a cache dir", s.get("writes", 0))
    yield _c("blockcache_write_bytes_total", "Bytes written to cache dirs", s.get("write_bytes", 0))
    yield _c("blockcache_write_errors_total", "Block writes that failed", s.get("write_errors", 0))
    yield _c("blockcache_drops_total", "Puts dropped because the fill queue was full",
             s.get("drops", 0))
    yield _c("blockcache_evictions_total", "Blocks evicted to make room (LRU), or dropped "
             "from the index because their file vanished (evict requests are not counted)",
             s.get("evictions", 0))
    yield _c("blockcache_evicted_bytes_total", "Bytes evicted", s.get("evicted_bytes", 0))
    by = CounterMetricFamily("blockcache_evictions_by_reason_total", "Blocks evicted, by "
                             "reason: admission (room for an admitted block), quota (its "
                             "volume's max_bytes), trim (the dir was above its high watermark), "
                             "max_entries, vanished (file gone behind the daemon's back)",
                             labels=["reason"])
    for reason, n in sorted((s.get("evictions_by_reason") or {}).items()):
        by.add_metric([reason], n)
    yield by
    p = s.get("policy") or {}
    adm = CounterMetricFamily("blockcache_admissions_total", "Admission decisions of the "
                              "capacity policy on puts: result admitted (reason room, "
                              "more_frequent) or refused (less_frequent)",
                              labels=["result", "reason"])
    for result, key in (("admitted", "admitted"), ("refused", "rejected")):
        for reason, n in sorted((p.get(key) or {}).items()):
            adm.add_metric([result, reason], n)
    yield adm
    yield _g("blockcache_policy_stale", "1 if the last window found the oldest cached blocks "
             "no longer hit and demoted them", 1 if p.get("stale") else 0)
    yield _c("blockcache_policy_demoted_total", "Cached blocks whose count the stale rule "
             "dropped to 0 (no longer hit: any block asked for before is admitted over them)",
             p.get("demoted", 0))
    slots = s.get("volume_slots") or {}
    yield _g("blockcache_volume_slots", "Volumes with blocks cached or puts queued (of "
             "max_volumes)", slots.get("held", 0))
    yield _g("blockcache_volume_slots_limit", "max_volumes", slots.get("limit", 0))
    yield _g("blockcache_entries", "Blocks in the cache", s.get("entries", 0))
    yield _g("blockcache_used_bytes", "Bytes of blocks in the cache", s.get("used_bytes", 0))
    yield _g("blockcache_capacity_bytes", "Configured capacity over all dirs",
             s.get("capacity_bytes", 0))
    q = s.get("queue") or {}
    yield _g("blockcache_fill_queue_entries", "Puts waiting to be written", q.get("entries", 0))
    yield _g("blockcache_fill_queue_bytes", "Bytes waiting to be written", q.get("bytes", 0))
    yield _g("blockcache_fill_queue_limit_bytes", "Fill queue bound", q.get("limit_bytes", 0))
    yield _g("blockcache_connections", "Connected clients", s.get("connections", 0))
    yield _c("blockcache_connections_total", "Connections accepted", s.get("connections_total", 0))
    areas = s.get("fill_areas") or {}
    yield _c("blockcache_fill_areas_opened_total", "Fill areas passed to readers",
             areas.get("opened", 0))
    yield _c("blockcache_fill_area_puts_total", "Puts of blocks from a fill area slot",
             areas.get("puts", 0))
    req = CounterMetricFamily("blockcache_requests_total", "Requests by op", labels=["op"])
    for op, n in sorted((s.get("requests") or {}).items()):
        req.add_metric([op], n)
    yield req
    err = CounterMetricFamily("blockcache_request_errors_total", "Error replies and bad frames "
                              "by code", labels=["code"])
    for code, n in sorted((s.get("errors") or {}).items()):
        err.add_metric([code], n)
    yield err
    refused = CounterMetricFamily("blockcache_refused_total", "Requests and connections refused "
                                  "because their peer uid was over its share (connections, "
                                  "reply_bytes, over_share, too_many_volumes, volume_share, "
                                  "read_budget)", labels=["kind"])
    for kind, n in sorted((s.get("refused") or {}).items()):
        refused.add_metric([kind], n)
    yield refused
    r = s.get("rebuild") or {}
    yield _g("blockcache_rebuild_running", "1 while the start-up scan runs",
             1 if r.get("state") == "running" else 0)
    yield _g("blockcache_rebuild_scanned_files", "Files seen by the start-up scan",
             r.get("scanned", 0))
    yield _g("blockcache_rebuild_indexed_entries", "Blocks indexed by the start-up scan",
             r.get("indexed", 0))
    yield _g("blockcache_rebuild_removed_files", "Temp and malformed files the scan removed",
             r.get("removed", 0))
    yield _g("blockcache_rebuild_seconds", "Duration of the finished start-up scan",
             r.get("seconds", 0.0))
    yield _g("blockcache_uptime_seconds", "Seconds since the daemon started", s.get("uptime", 0))


def _leases(le: dict[str, Any]) -> Iterator[Metric]:
    """Fetch leases (leases.py): one fetch per cold block on the host."""
    yield _c("blockcache_leases_taken_total", "Fetch leases granted: a reader fetches the "
             "block, others wait for its fill", le.get("taken", 0))
    yield _c("blockcache_lease_waits_total", "Waits for another reader's fetch",
             le.get("waits", 0))
    yield _c("blockcache_lease_fetches_saved_total", "Waits answered with the block in the "
             "cache: fetches from the remote saved", le.get("saved", 0))
    ended = CounterMetricFamily("blockcache_leases_ended_total", "Fetch leases by how they "
                                "ended: filled (the block landed), expired (lease_timeout "
                                "passed), lost (the holder's connection closed), declined (the "
                                "block was not cached), released (the holder gave it up)",
                                labels=["how"])
    for how in ("filled", "expired", "lost", "declined", "released"):
        ended.add_metric([how], le.get(how, 0))
    yield ended
    yield _c("blockcache_leases_refused_total", "Blocks fetched without a lease: the peer's "
             "uid held max_leases_per_uid (or the daemon its most)", le.get("refused", 0))
    yield _g("blockcache_leases_held", "Fetch leases held now", le.get("held", 0))
    yield _g("blockcache_lease_waiters", "Readers waiting for a fill now", le.get("waiting", 0))


def _dirs(dirs: list[dict[str, Any]]) -> Iterator[Metric]:
    rows = _Labelled(["dir"])
    for d in dirs:
        v = [d["path"]]
        limit = d.get("limit_bytes", 0)
        rows.add(GaugeMetricFamily, "blockcache_dir_healthy", "1 if the cache dir is in "
                 "service, 0 if taken out after I/O errors", v, 1 if d.get("healthy") else 0)
        rows.add(GaugeMetricFamily, "blockcache_dir_used_bytes", "Bytes of blocks in the dir",
                 v, d.get("used_bytes", 0))
        rows.add(GaugeMetricFamily, "blockcache_dir_entries", "Blocks in the dir", v,
                 d.get("entries", 0))
        rows.add(GaugeMetricFamily, "blockcache_dir_capacity_bytes", "Configured size of the dir",
                 v, d.get("capacity_bytes", 0))
        rows.add(GaugeMetricFamily, "blockcache_dir_limit_bytes", "Effective limit: the size, "
                 "or less when the free-space floor binds", v, limit)
        rows.add(GaugeMetricFamily, "blockcache_dir_high_watermark_bytes", "Usage at which "
                 "eviction starts (high watermark x limit)", v, d.get("high_watermark", 0) * limit)
        rows.add(GaugeMetricFamily, "blockcache_dir_low_watermark_bytes", "Usage eviction "
                 "brings the dir down to (low watermark x limit)", v,
                 d.get("low_watermark", 0) * limit)
        rows.add(GaugeMetricFamily, "blockcache_dir_reserved_bytes", "Bytes of admitted puts "
                 "not written yet", v, d.get("reserved_bytes", 0))
        rows.add(GaugeMetricFamily, "blockcache_dir_free_bytes", "Free bytes of the file "
                 "system at the last statvfs (-1 unknown)", v, d.get("free_bytes", -1))
        rows.add(GaugeMetricFamily, "blockcache_dir_free_inodes", "Free inodes of the file "
                 "system at the last statvfs (-1 unknown)", v, d.get("free_inodes", -1))
        rows.add(CounterMetricFamily, "blockcache_dir_io_errors_total", "I/O errors and "
                 "timeouts on the dir", v, d.get("io_errors", 0))
        rows.add(GaugeMetricFamily, "blockcache_dir_rebuilding", "1 while the dir is scanned",
                 v, 1 if d.get("rebuilding") else 0)
        rows.add(GaugeMetricFamily, "blockcache_dir_queued_jobs", "Jobs waiting for the dir's "
                 "worker thread", v, d.get("queued_jobs", 0))
    yield from rows.families.values()


def _volumes(volumes: dict[str, dict[str, int]]) -> Iterator[Metric]:
    rows = _Labelled(["volume"])
    for name, v in volumes.items():
        rows.add(GaugeMetricFamily, "blockcache_volume_entries", "Blocks of the volume in the "
                 "cache", [name], v.get("entries", 0))
        rows.add(GaugeMetricFamily, "blockcache_volume_used_bytes", "Bytes of the volume's "
                 "blocks in the cache", [name], v.get("used_bytes", 0))
        rows.add(GaugeMetricFamily, "blockcache_volume_quota_bytes", "The volume's max_bytes "
                 "in the cache (0: no quota)", [name], v.get("quota_bytes", 0))
        rows.add(CounterMetricFamily, "blockcache_volume_hits_total", "Hits readers of the "
                 "volume reported (touches)", [name], v.get("touches", 0))
        rows.add(CounterMetricFamily, "blockcache_volume_hit_bytes_total", "Block-file bytes "
                 "of those hits", [name], v.get("touch_bytes", 0))
        rows.add(CounterMetricFamily, "blockcache_volume_puts_total", "Blocks readers of the "
                 "volume offered after a miss", [name], v.get("puts", 0))
        rows.add(CounterMetricFamily, "blockcache_volume_put_bytes_total", "Block-file bytes "
                 "of those puts", [name], v.get("put_bytes", 0))
    yield from rows.families.values()


# the cluster tier as readers reported it: (stats key, series, help)
_CLUSTER_SERIES = (
    ("hits", "hits", "Blocks or ranges readers found in the cluster tier"),
    ("misses", "misses", "Blocks or ranges readers did not find in the cluster tier"),
    ("bytes", "bytes", "Item bytes readers received from the cluster tier"),
    ("errors", "errors", "memcached requests that failed or timed out (the server is then "
                         "skipped for retry_after)"),
    ("bad", "bad_items", "Tier items that failed authentication or shape checks (deleted)"),
    ("fills_sent", "fills_sent", "Blocks readers stored in the cluster tier"),
    ("fills_dropped", "fills_dropped", "Tier fills dropped (queue full, no server)"),
)


def _cluster(volumes: dict[str, dict[str, int]]) -> Iterator[Metric]:
    rows = _Labelled(["volume"])
    for name, v in volumes.items():
        for key, series, text in _CLUSTER_SERIES:
            rows.add(CounterMetricFamily, f"blockcache_cluster_{series}_total",
                     f"{text}, as the volume's readers reported", [name], v.get(key, 0))
    yield from rows.families.values()


def start(addr: str, loop: asyncio.AbstractEventLoop, service: Any) -> MetricsServer:
    """Time requests and serve the daemon's metrics on `addr` (HOST:PORT)."""
    latency = service.latency = Histogram()

    def take() -> Snapshot:
        service.cache.finish_writes()  # as a request would: writes done so far count
        return service.stats({}, None), latency.snapshot()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(snapshot_on_loop(loop, take), latency))
    ProcessCollector(registry=registry)  # RSS, CPU, open fds of the daemon
    return MetricsServer(addr, registry)
