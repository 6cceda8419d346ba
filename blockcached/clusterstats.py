"""The cluster tier as readers see it, summed per volume for `stats`.

Readers talk to memcached themselves, so the daemon only learns what they
report: each reader's link adds the growth of its `cluster_*` counters since
its last report to a `ping` or `touch` (`cluster: {volume, counters}`). A
report for a volume the peer may not use, or one that is malformed, is
ignored (stats only: it never fails the ping or touch carrying it).
"""

from __future__ import annotations

from typing import Any

from blockcache_client.contract.blockkey import check_volume_name
from blockcache_client.contract.cluster import ClusterConfig
from blockcache_client.contract.errors import InvalidKey

# what readers report (blockcache_client.common.counters.CLUSTER_COUNTERS, without
# the prefix); a report's other names are ignored
COUNTERS = ("hits", "misses", "bytes", "errors", "bad", "fills_sent", "fills_dropped")
_MAX_DELTA = 1 << 62


class ClusterStats:
    """Per-volume sums of the readers' cluster counters, at most
    `max_volumes` volumes (later ones are not counted)."""

    def __init__(self, cfg: ClusterConfig | None, max_volumes: int):
        self.cfg = cfg
        self.max_volumes = max_volumes
        self.volumes: dict[str, dict[str, int]] = {}
        self.ignored = 0  # malformed reports, or for volumes the peer may not use

    def note(self, report: Any, may_use) -> None:
        """Add one reader's report; `may_use(volume)` says if its peer may."""
        try:
            vol = check_volume_name(report["volume"])
            counters = report["counters"]
            deltas = {k: counters.get(f"cluster_{k}", 0) for k in COUNTERS}
        except (TypeError, KeyError, AttributeError, InvalidKey):
            self.ignored += 1
            return
        if (not all(type(v) is int and 0 <= v < _MAX_DELTA for v in deltas.values())
                or not may_use(vol)):
            self.ignored += 1
            return
        sums = self.volumes.get(vol)
        if sums is None:
            if len(self.volumes) >= self.max_volumes:
                self.ignored += 1
                return
            sums = self.volumes[vol] = dict.fromkeys(COUNTERS, 0)
        for k, v in deltas.items():
            sums[k] += v

    def stats(self) -> dict[str, Any]:
        total = dict.fromkeys(COUNTERS, 0)
        for sums in self.volumes.values():
            for k, v in sums.items():
                total[k] += v
        return {"enabled": self.cfg is not None,
                "memcached": list(self.cfg.memcached) if self.cfg else [],
                **total, "reports_ignored": self.ignored,
                "volumes": {v: dict(s) for v, s in sorted(self.volumes.items())}}
