"""How a warmup run ends: its exit codes, and Ctrl-C or SIGTERM, raised as
`Interrupted` in the main thread, which then stops submitting and reports."""

from __future__ import annotations

import signal
from concurrent.futures import Future
from typing import Any

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; the run stops submitting and reports."""


def raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def wait_result(fut: Future) -> Any:
    """fut.result(), waiting in short steps so Ctrl-C is seen at once."""
    while True:
        try:
            return fut.result(timeout=0.5)
        except TimeoutError:
            continue
