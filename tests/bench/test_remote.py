"""The latency proxy forwards bytes unchanged, holds them for the round trip, and counts them."""

import socket
import socketserver
import threading
import time

import pytest

from bench.remote import LatencyProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_server():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy(echo_server):
    p = LatencyProxy(echo_server, rtt_ms=100.0).start()
    try:
        yield p
    finally:
        p.stop()


def _roundtrip(port: int, payload: bytes) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(1 << 20)
            assert chunk, "proxy closed the connection early"
            got += chunk
        return got, time.monotonic() - t0


def test_proxy_forwards_bytes_unchanged_after_the_round_trip(proxy):
    payload = bytes(range(256)) * 4096          # 1 MiB, several chunks
    got, elapsed = _roundtrip(proxy.port, payload)
    assert got == payload
    # Half the round trip each way: nothing can come back sooner.
    assert elapsed >= 0.1


def test_proxy_counts_connections_requests_and_bytes(proxy):
    before = proxy.counters()
    _roundtrip(proxy.port, b"GET /bucket/key HTTP/1.1\r\nHost: x\r\n\r\n")
    _roundtrip(proxy.port, b"HEAD /bucket/key HTTP/1.1\r\nHost: x\r\n\r\n")
    deadline = time.monotonic() + 5
    while (after := proxy.counters())["connections"] < before["connections"] + 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert after["requests"] - before["requests"] == 2
    assert after["bytes_up"] - before["bytes_up"] == after["bytes_down"] - before["bytes_down"]


def test_remote_serves_s3_through_the_delay(bench_ctx):
    import s3fs
    remote = bench_ctx.remote
    direct = s3fs.S3FileSystem(skip_instance_cache=True, **remote.storage_options(direct=True))
    direct.pipe(f"{remote.bucket}/remote-test/b.bin", b"x" * 5000)
    delayed = s3fs.S3FileSystem(skip_instance_cache=True, **remote.storage_options())
    c0 = remote.counters()
    assert delayed.cat_file(f"{remote.bucket}/remote-test/b.bin") == b"x" * 5000
    c1 = remote.counters()
    assert c1["requests"] > c0["requests"]
    assert c1["bytes_down"] - c0["bytes_down"] >= 5000
    assert "proxy" in remote.method and "netem" in remote.note
