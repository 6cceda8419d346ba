"""Health of the cache dirs: failing disks are taken out and probed back in.

A dir is marked unhealthy after `ERROR_LIMIT` I/O errors in a row, or at once
when an operation on it runs longer than the I/O timeout (a hung disk). An
unhealthy dir's keys are misses and puts to it are refused; placement does
not change (readers compute the same paths), so when a probe succeeds the
dir's existing blocks are served again. Every change bumps `epoch`, which the
daemon reports as `layout_epoch` so readers re-fetch the layout.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

ERROR_LIMIT = 3
PROBE_INTERVAL = 2.0  # seconds between probes of an unhealthy dir


class Health:
    """Healthy/unhealthy state per dir, and the layout epoch."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self.healthy = [True] * len(paths)
        self.errors = [0] * len(paths)        # consecutive errors
        self.error_total = [0] * len(paths)
        self.reason = [""] * len(paths)
        self.next_probe = [0.0] * len(paths)
        # Start from the clock so a restarted daemon never repeats an epoch a
        # reader may still hold (its config may have changed meanwhile).
        self.epoch = time.time_ns() // 1_000_000

    def ok(self, i: int) -> None:
        self.errors[i] = 0

    def error(self, i: int, exc: BaseException) -> bool:
        """Count an I/O error; True if it took the dir out."""
        self.errors[i] += 1
        self.error_total[i] += 1
        log.warning("cache dir %s: I/O error %d in a row: %s", self.paths[i], self.errors[i], exc)
        if self.errors[i] >= ERROR_LIMIT:
            return self.mark_unhealthy(i, f"{self.errors[i]} I/O errors in a row, last: {exc}")
        return False

    def timeout(self, i: int, seconds: float) -> bool:
        return self.mark_unhealthy(i, f"an operation has been running for {seconds:.1f}s")

    def mark_unhealthy(self, i: int, why: str) -> bool:
        if not self.healthy[i]:
            return False
        self.healthy[i] = False
        self.reason[i] = why
        self.next_probe[i] = time.monotonic() + PROBE_INTERVAL
        self.epoch += 1
        log.error("cache dir %s is now unhealthy (%s); its blocks are misses until a probe "
                  "succeeds", self.paths[i], why)
        return True

    def probe_due(self, i: int, now: float) -> bool:
        if self.healthy[i] or now < self.next_probe[i]:
            return False
        self.next_probe[i] = now + PROBE_INTERVAL
        return True

    def probe_result(self, i: int, exc: BaseException | None) -> bool:
        """Apply a probe's outcome; True if the dir came back."""
        if exc is not None:
            log.info("cache dir %s: probe failed: %s", self.paths[i], exc)
            return False
        if self.healthy[i]:
            return False
        self.healthy[i] = True
        self.errors[i] = 0
        self.reason[i] = ""
        self.epoch += 1
        log.warning("cache dir %s is healthy again", self.paths[i])
        return True
