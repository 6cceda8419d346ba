"""Prometheus metrics of one mount, labelled by volume (`--metrics-addr`).

Read at scrape time from what the mount already counts, so the numbers agree
with the `user.blockcache.stats` xattr: the reader's `Volume.stats()`
(thread-safe counters), the FUSE session's requests per operation, handling
times and busy workers, the mount's open files and inodes, and remote request
latencies and errors from the `Backend.observe` hook. The endpoint runs on
prometheus-client's own thread, never on a FUSE worker.

Every series is labelled `volume`; several mounts on one host each serve
their own address (pick one port per mount).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from blockcache_client.common.metrics import LockedHistogram, MetricsServer

log = logging.getLogger(__name__)

# Volume counter -> (metric name, help). Every counter of `counters.VOLUME_COUNTERS`.
COUNTERS = {
    "hits": ("blockcache_client_hits_total", "Block reads served from the host cache "
             "(disk or the in-process memory cache)"),
    "misses": ("blockcache_client_misses_total", "Block reads that went to the source"),
    "hit_bytes": ("blockcache_client_hit_bytes_total", "Bytes returned from the cache"),
    "miss_bytes": ("blockcache_client_miss_bytes_total", "Bytes returned after a miss"),
    "memory_hits": ("blockcache_client_memory_hits_total", "Hits from the in-process memory cache"),
    "backend_bytes": ("blockcache_client_backend_bytes_total", "Bytes read from the source"),
    "backend_requests": ("blockcache_client_backend_requests_total",
                         "Requests to the source (block reads and version checks)"),
    "fills_sent": ("blockcache_client_fills_sent_total", "Blocks handed to blockcached"),
    "fills_dropped": ("blockcache_client_fills_dropped_total", "Fills dropped (queue full, "
                      "daemon down or refusing): those blocks stay uncached"),
    "integrity_failures": ("blockcache_client_integrity_failures_total", "Cached blocks that "
                           "failed authentication or their format check (evicted, read remote)"),
    "daemon_unavailable": ("blockcache_client_fail_open_reads_total", "Reads that went to the "
                           "source because blockcached was unreachable"),
    "prefetches": ("blockcache_client_prefetches_total", "Blocks fetched ahead of readers"),
    "prefetches_dropped": ("blockcache_client_prefetches_dropped_total",
                           "Readahead jobs dropped (too many queued)"),
    "prefetches_cancelled": ("blockcache_client_prefetches_cancelled_total",
                             "Readahead jobs cancelled before they ran (the reader closed "
                             "or seeked away)"),
    "version_checks": ("blockcache_client_version_checks_total", "Extra stats confirming a "
                       "multi-block file did not change during a block read"),
    "chunk_hits": ("blockcache_client_chunk_hits_total", "Hits served from decrypted chunks "
                   "kept in memory (no decryption)"),
    "evictions_refused": ("blockcache_client_evictions_refused_total", "Evictions of bad "
                          "cached blocks the daemon refused (the volume's access rules)"),
    "leases_taken": ("blockcache_client_leases_taken_total", "Blocks leased from blockcached "
                     "before fetching them: other readers on the host wait for their fill"),
    "lease_waits": ("blockcache_client_lease_waits_total", "Waits for another reader's fetch "
                    "of a block (its lease)"),
    "lease_saved": ("blockcache_client_lease_saved_total", "Waits that found the block "
                    "cached: fetches saved"),
    "lease_gave_up": ("blockcache_client_lease_gave_up_total", "Waits that ended without the "
                      "block (its holder died, expired or released it; the daemon gone): "
                      "fetched here"),
    "cold_opens": ("blockcache_client_cold_opens_total", "Files of a cold directory opened "
                   "by their first block's GET, without a stat (Volume.open only)"),
    "chunks_decrypted": ("blockcache_client_chunks_decrypted_total", "Chunks of cached "
                         "blocks a hit decrypted (the cache disk's, not the tier's)"),
    "cluster_hits": ("blockcache_client_cluster_hits_total", "Blocks or ranges found in the "
                     "cluster tier"),
    "cluster_misses": ("blockcache_client_cluster_misses_total", "Blocks or ranges not found "
                       "in the cluster tier"),
    "cluster_bytes": ("blockcache_client_cluster_bytes_total", "Item bytes received from the "
                      "cluster tier"),
    "cluster_errors": ("blockcache_client_cluster_errors_total", "memcached requests that "
                       "failed or timed out (the server is then skipped for retry_after)"),
    "cluster_bad": ("blockcache_client_cluster_bad_items_total", "Cluster tier items that "
                    "failed authentication or shape checks (deleted, read from the source)"),
    "cluster_fills_sent": ("blockcache_client_cluster_fills_sent_total", "Blocks stored in "
                           "the cluster tier"),
    "cluster_fills_dropped": ("blockcache_client_cluster_fills_dropped_total", "Cluster tier "
                              "fills dropped (queue full, no server)"),
    "staged_bytes": ("blockcache_client_staged_bytes_total", "Bytes written into staged files "
                     "(writable mounts)"),
    "uploads": ("blockcache_client_uploads_total", "Staged files uploaded as one object each "
                "(on close or fsync)"),
    "uploaded_bytes": ("blockcache_client_uploaded_bytes_total", "Bytes of the objects "
                       "uploaded"),
    "upload_ms": ("blockcache_client_upload_milliseconds_total", "Time spent uploading "
                  "(from the first part to the object's completion)"),
    "uploads_failed": ("blockcache_client_uploads_failed_total", "Uploads that failed (the "
                       "close or fsync answered EIO; nothing of them stays)"),
}


class BackendTimer:
    """`Backend.observe`: latency by request kind; errors by kind and reason."""

    def __init__(self) -> None:
        self.latency = LockedHistogram()
        self.errors: dict[tuple[str, str], int] = {}

    def __call__(self, what: str, seconds: float, exc: BaseException | None) -> None:
        self.latency.observe(what, seconds)
        if exc is not None:
            reason = _reason(exc)
            with self.latency.lock:
                self.errors[(what, reason)] = self.errors.get((what, reason), 0) + 1


def _reason(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "not_found"
    if isinstance(exc, PermissionError):
        return "permission"
    if isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT:
        return "timeout"
    return "error"


class MountCollector(Collector):
    """The mount's metrics, from the reader, the FUSE layer and the backend hook."""

    def __init__(self, volume: Any, fs: Any, session: Any, backend: BackendTimer):
        self.volume = volume
        self.fs = fs
        self.session = session
        self.backend = backend
        self.name = volume.name

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        v = [self.name]
        stats = self.volume.stats()
        for key, (name, doc) in COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=["volume"])
            fam.add_metric(v, stats.get(key, 0))
            yield fam
        for name, doc, value in (
                ("blockcache_client_daemon_connected", "1 while blockcached is reachable",
                 1 if stats.get("daemon_connected") else 0),
                ("blockcache_client_fill_queue_bytes", "Bytes waiting to be sent to blockcached",
                 stats.get("fill_queue_bytes", 0)),
                ("blockcache_client_memory_bytes", "Bytes in the in-process memory cache",
                 stats.get("memory_bytes", 0)),
                ("blockcache_client_staging_bytes", "Disk bytes held by staged files now "
                 "(bounded by staging_bytes)", stats.get("staging_used_bytes", 0)),
                ("blockcache_fuse_open_files", "Open file handles", len(self.fs.open_files)),
                ("blockcache_fuse_inodes", "Inodes the kernel holds", len(self.fs.nodes)),
                ("blockcache_fuse_workers", "FUSE worker threads", len(self.session.workers)),
                ("blockcache_fuse_workers_busy", "FUSE requests being served now (waits included)",
                 self.session.busy())):
            fam = GaugeMetricFamily(name, doc, labels=["volume"])
            fam.add_metric(v, value)
            yield fam
        mount = self.fs.mount_stats()
        for name, doc, key in (
                ("blockcache_fuse_rss_bytes", "The FUSE server's resident memory",
                 "server_rss_bytes"),
                ("blockcache_fuse_rss_bound_bytes", "The most memory the FUSE server holds "
                 "with its settings", "server_rss_bound_bytes"),
                ("blockcache_fuse_max_nodes", "Inodes the server tracks at most (max_nodes)",
                 "max_nodes")):
            fam = GaugeMetricFamily(name, doc, labels=["volume"])
            fam.add_metric(v, mount[key])
            yield fam
        for name, doc, key in (
                ("blockcache_fuse_nodes_asked_to_forget_total", "Inodes the kernel was asked "
                 "to forget to keep the node table under max_nodes", "nodes_asked_to_forget"),
                ("blockcache_fuse_nodes_recovered_total", "Inodes the kernel held that this "
                 "server took over from the one before it", "nodes_recovered"),
                ("blockcache_fuse_handles_recovered_total", "Open file and directory handles "
                 "this server took over from the one before it", "handles_recovered"),
                ("blockcache_fuse_stale_answers_total", "Reads of a handle answered ESTALE "
                 "because a later open found a new version of its file", "stale_answers")):
            fam = CounterMetricFamily(name, doc, labels=["volume"])
            fam.add_metric(v, mount[key])
            yield fam
        const = {"volume": self.name}
        yield self.backend.latency.family(
            "blockcache_client_backend_request_seconds", "Source request time with retries, "
            "by kind (stat, list, read, readlink; upload, mkdir, rmdir, unlink, rename)",
            "kind", const=const)
        with self.backend.latency.lock:
            errors = dict(self.backend.errors)
        fam = CounterMetricFamily("blockcache_client_backend_errors_total", "Source requests "
                                  "that failed (after retries), by kind and reason",
                                  labels=["volume", "kind", "reason"])
        for (kind, reason), n in sorted(errors.items()):
            fam.add_metric([self.name, kind, reason], n)
        yield fam
        fam = CounterMetricFamily("blockcache_fuse_ops_total", "FUSE requests by operation",
                                  labels=["volume", "op"])
        for op, n in sorted(self.session.op_counts().items()):
            fam.add_metric([self.name, op], n)
        yield fam
        if self.session.latency is not None:
            yield self.session.latency.family("blockcache_fuse_op_seconds", "FUSE request "
                                            "handling time by operation", "op", const=const)


def start(addr: str, volume: Any, fs: Any, session: Any) -> MetricsServer:
    """Time FUSE requests and source requests, and serve the mount's metrics on `addr`."""
    timer = BackendTimer()
    volume.backend.observe = timer
    session.latency = LockedHistogram()  # observed on every worker thread
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MountCollector(volume, fs, session, timer))
    ProcessCollector(registry=registry)
    return MetricsServer(addr, registry)
