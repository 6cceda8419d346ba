"""Polling for a condition in a test, bounded in time."""

from __future__ import annotations

import time

import pytest


def wait_for(cond, timeout: float = 10.0, what: str = "condition"):
    """Poll until cond() is truthy; fail the test with `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)
