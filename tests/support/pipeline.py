"""Several requests in one write on a `Client`'s connection: what tests use
to send malformed or many requests at once and read every reply, errors
included (the library's own callers never need it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from blockcache_client.daemonclient.client import Client


def pipeline(client: Client, calls: Iterable[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Send the (op, args) requests in one write; their reply maps in order.
    Error replies are returned, not raised."""
    reqs = [{"id": client._next_id(), "op": op, **args} for op, args in calls]
    return client._exchange(reqs) if reqs else []
