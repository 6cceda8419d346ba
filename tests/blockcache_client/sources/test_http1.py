"""`http1`: the sockets S3 GETs go out on. Kept alive where the server keeps
them (a real S3 server behind an HTTP/1.1 front), replaced when the server
closed one while idle, and an answer it cannot read whole is an error, never
short bytes."""

from __future__ import annotations

import pytest

from blockcache_client.sources.backend import Backend
from blockcache_client.sources.http1 import Connections, HTTPError
from tests.support.s3front import S3Front
from tests.support.scripted_http import ScriptedHTTP

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"


def test_gets_reuse_one_kept_alive_connection(s3_server):
    fs = s3_server.filesystem()
    fs.pipe_file(f"{s3_server.bucket}/ka/f.bin", bytes(range(256)) * 400)
    with S3Front(s3_server.endpoint_url) as front:
        opts = dict(s3_server.storage_options, endpoint_url=front.url)
        b = Backend(s3_server.url("ka"), timeout=10, attempts=2, **opts)
        try:
            before = front.connections  # s3fs's own (listing at start)
            for start in range(0, 100_000, 10_000):
                assert b.read("f.bin", start, start + 7) == (bytes(range(256)) * 400)[
                    start:start + 7]
            assert b._direct._http.opened == 1
            assert front.connections - before == 1
        finally:
            b.close()


def test_a_connection_the_server_closed_while_idle_is_replaced():
    # no "Connection: close": the client keeps it, then finds it closed
    with ScriptedHTTP([(OK, True), (OK, False)]) as srv:
        pool = Connections(5.0, 2)
        for _ in range(2):
            resp = pool.get("http", "127.0.0.1", srv.port, "/k", {"Range": "bytes=0-4"})
            assert (resp.status, resp.read(10)) == (200, b"hello")
            resp.release()
        assert pool.opened == 2 and srv.connections == 2
        assert srv.requests[0].startswith(b"GET /k HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"\r\nRange: bytes=0-4\r\n" in srv.requests[0]
        pool.clear()


def test_a_body_cut_short_is_an_error_and_not_kept():
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello"
    with ScriptedHTTP([(cut, True)]) as srv:
        pool = Connections(5.0, 2)
        resp = pool.get("http", "127.0.0.1", srv.port, "/k", {})
        with pytest.raises(HTTPError, match="5 bytes before the end"):
            resp.read(10)
        resp.release()
        assert not pool._idle.get(("http", "127.0.0.1", srv.port))


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"HTTP/1.0 200 OK\r\n\r\nhello"])
def test_a_body_of_unknown_length_is_never_read_as_data(answer):
    with ScriptedHTTP([(answer, True)]) as srv:
        pool = Connections(5.0, 2)
        resp = pool.get("http", "127.0.0.1", srv.port, "/k", {})
        assert resp.status == 200 and not resp.body_known and resp.read(5) == b""
        resp.release()
        assert not pool._idle.get(("http", "127.0.0.1", srv.port))


def test_not_http_is_an_error():
    with ScriptedHTTP([(b"SSH-2.0-OpenSSH\r\n\r\n", True)]) as srv:
        with pytest.raises(HTTPError, match="not an HTTP/1.x status line"):
            Connections(5.0, 2).get("http", "127.0.0.1", srv.port, "/k", {})
