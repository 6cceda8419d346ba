"""The memcached client against servers that misbehave. A real memcached
never does; a socket on loopback that answers whatever it is told to does."""

from __future__ import annotations

import socket
import threading

import pytest

from blockcache_client.cluster.memcache import Memcache, ServerFailed


def _server(answer: bytes):
    """A one-connection server that reads a request, then sends `answer`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(answer)
            conn.recv(4096)  # until the client closes

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_a_value_for_a_key_not_asked_for_fails_the_server():
    """Its bytes must not land where another key's would (or crash the
    caller's placement): the server is wrong, the read a miss."""
    listener = _server(b"VALUE bc1:other:0 0 3\r\nabc\r\nEND\r\n")
    client = Memcache(listener.getsockname(), 1.0, 1.0)
    placed = []
    try:
        with pytest.raises(ServerFailed, match="not asked for"):
            client.get_into({"bc1:mine:0": 3}, lambda k, n: placed.append(k) or [])
        assert placed == []
    finally:
        client.close()
        listener.close()


def test_a_timeout_says_so_and_a_refusal_does_not():
    """The pool probes a server that timed out (busy or stalled), and only
    skips one that refused (gone)."""
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    address = listener.getsockname()
    client = Memcache(address, 1.0, 0.1)
    try:
        with pytest.raises(ServerFailed) as timed_out:
            client.get_into({"k": 3}, lambda k, n: [])
        assert timed_out.value.timed_out
        assert not client.answers(0.1)
    finally:
        client.close()
        listener.close()
    gone = Memcache(address, 1.0, 0.1)  # nothing listens there now
    with pytest.raises(ServerFailed) as refused:
        gone.get_into({"k": 3}, lambda k, n: [])
    assert not refused.value.timed_out
