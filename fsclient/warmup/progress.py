"""What a warmup did so far (`Tally`) and the progress line drawn from it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

from blockcache_client.contract.units import format_size

MAX_LISTED_FAILURES = 50   # failures printed by name in the summary (all are counted)


@dataclass
class Tally:
    """What a warmup did so far; updated from worker threads under `lock`."""

    files: int = 0
    bytes: int = 0
    cached_bytes: int = 0
    cached_blocks: int = 0
    fetched_bytes: int = 0
    failed_bytes: int = 0
    skipped_links: int = 0
    other_shard_files: int = 0   # with --shard: files left to the other hosts
    other_shard_bytes: int = 0
    failures: dict[str, str] = field(default_factory=dict)
    failed_count: int = 0
    listed_all: bool = False   # enumeration finished: `bytes` is the total
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fail(self, path: str, reason: str) -> None:
        with self.lock:
            if path in self.failures:
                return
            self.failed_count += 1
            if len(self.failures) < MAX_LISTED_FAILURES:
                self.failures[path] = reason

    @property
    def done_bytes(self) -> int:
        return self.cached_bytes + self.fetched_bytes + self.failed_bytes


class Progress:
    """A one-line bar redrawn on a terminal; a plain line every `interval` s otherwise."""

    def __init__(self, tally: Tally, out: TextIO, tty: bool, interval: float):
        self.tally = tally
        self.out = out
        self.tty = tty
        self.interval = 0.2 if tty else interval
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="warmup-progress", daemon=True)

    def start(self) -> Progress:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.tty:
            self.out.write("\r\x1b[K")
            self.out.flush()

    def _run(self) -> None:
        if self.tty:  # a terminal shows the bar at once, then redraws it in place
            self._draw()
        while not self._stop.wait(self.interval):
            self._draw()

    def _draw(self) -> None:
        line = self.line()
        self.out.write(f"\r\x1b[K{line}" if self.tty else line + "\n")
        self.out.flush()

    def line(self) -> str:
        t = self.tally
        elapsed = max(time.monotonic() - self.started, 1e-6)
        done = t.done_bytes
        rate = t.fetched_bytes / elapsed
        if t.listed_all and t.bytes:
            frac = min(1.0, done / t.bytes)
            left = (t.bytes - done) / (done / elapsed) if done else float("inf")
            eta = clock(left)
            bar = "#" * int(frac * 20)
            head = f"[{bar:<20}] {100 * frac:5.1f}% "
        else:
            eta, head = "?", "[listing...] "
        return (f"warmup {head}files {t.files}  {format_size(done)} of "
                f"{format_size(t.bytes)}{'' if t.listed_all else '+'}  "
                f"fetched {format_size(t.fetched_bytes)} at {format_size(rate)}/s  "
                f"failed {t.failed_count}  ETA {eta}")


def clock(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
