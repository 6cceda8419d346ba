"""An HTTP front on loopback before a real S3 server: forwards every request,
records what it saw, and answers chosen GETs with a chosen status instead.

    with S3Front(s3_server.endpoint_url) as front:
        front.fail_gets(503, times=2)       # the next two GETs get a 503
        opts = dict(s3_server.storage_options, endpoint_url=front.url)
        ...
        front.gets, front.puts              # [(path, user agent), ...]
        front.requests                      # [(method, path), ...]: every request
        front.connections                   # TCP connections opened to it
        front.fail_writes(403, "partNumber=2")  # PUTs/POSTs whose path holds it: 403
        front.stall_writes(5.0, "partNumber=2")  # ...or held 5 s before they go on
        front.down_at_write("partNumber=2")  # ...or the front goes down when one comes
        front.down = True                   # every request: the connection just closes
        front.body_bytes("data/x/f.bin")    # bytes of GET bodies sent for that object
        front.stall_gets(2.0)               # each GET's answer waits 2 s first

Lets tests see which client sent a GET and how a reader meets throttling,
refusals and redirects, and how a writer meets a remote that refuses, goes
down or stalls mid-upload, with the real server answering everything else.
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}
_DOWN = "down"  # a write fault's status: the front goes down (`down_at_write`)


class S3Front:
    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.gets: list[tuple[str, str]] = []
        self.requests: list[tuple[str, str]] = []  # (method, path with its query)
        self.puts: list[tuple[str, str]] = []  # (path with its query, user agent)
        self.connections = 0  # TCP connections clients opened to the front
        self.regions: list[str] = []  # the region each GET was signed for ("" unsigned)
        self.sent: dict[str, int] = {}  # GET body bytes sent per path (no query)
        self.stall = 0.0  # seconds each GET's answer waits before it is sent
        self._faults: list[tuple[int, dict]] = []
        # [path substring, status or None, seconds held, times left or None]
        # for PUT, POST and DELETE
        self._write_faults: list[list] = []
        self.down = False
        self._lock = threading.Lock()
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                with front._lock:
                    front.connections += 1
                super().setup()

            def _any(self):
                if front.down:
                    self.close_connection = True
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with front._lock:
                    front.requests.append((self.command, self.path))
                fault = None
                if self.command == "PUT":
                    with front._lock:
                        front.puts.append((self.path, self.headers.get("User-Agent", "")))
                if self.command in ("PUT", "POST", "DELETE"):
                    fault = front.write_fault(self.path)
                    if front.down:  # gone while this request was held
                        self.close_connection = True
                        return
                elif self.command == "GET":
                    fault = front.next_fault(self.path, self.headers.get("User-Agent", ""),
                                              self.headers.get("Authorization", ""))
                if fault is not None:
                    status, headers = fault
                    payload = (f"<Error><Code>Injected{status}</Code>"
                               f"<Message>injected by S3Front</Message></Error>").encode()
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(front.upstream.hostname, front.upstream.port,
                                                  timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in _HOP_BY_HOP and k.lower() != "expect"}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    if self.command == "GET":
                        path = self.path.partition("?")[0].lstrip("/")
                        with front._lock:
                            front.sent[path] = front.sent.get(path, 0) + len(data)
                        if front.stall:
                            time.sleep(front.stall)
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    # a HEAD's answer has no body but the length of the object's
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def fail_gets(self, status: int, times: int = 1, headers: dict | None = None) -> None:
        """Answer the next `times` GETs with `status` (and `headers`)."""
        with self._lock:
            self._faults.extend([(status, dict(headers or {}))] * times)

    def fail_writes(self, status: int, where: str = "", times: int | None = None) -> None:
        """Answer `status` to every PUT, POST or DELETE whose path (with its
        query) holds `where`, from now on (the next `times` only, if given)."""
        with self._lock:
            self._write_faults.append([where, status, 0.0, times])

    def stall_writes(self, seconds: float, where: str = "") -> None:
        """Hold every PUT, POST or DELETE whose path holds `where` for
        `seconds` before it goes on (a remote slow mid-upload)."""
        with self._lock:
            self._write_faults.append([where, None, seconds, None])

    def down_at_write(self, where: str) -> None:
        """Go down when the next PUT, POST or DELETE whose path holds `where`
        arrives (a remote lost mid-upload, at a known point): that request
        and every one after it find their connection closed."""
        with self._lock:
            self._write_faults.append([where, _DOWN, 0.0, 1])

    def clear_writes(self) -> None:
        with self._lock:
            self._write_faults.clear()

    def write_fault(self, path: str) -> tuple[int, dict] | None:
        """The fault for a write request to `path`, after any stall it gets."""
        with self._lock:
            found = [f for f in self._write_faults if f[0] in path and f[3] != 0]
            for f in found:
                if f[3] is not None:
                    f[3] -= 1
        for _, _, seconds, _ in found:
            if seconds:
                time.sleep(seconds)
        if any(status == _DOWN for _, status, _, _ in found):
            self.down = True  # (the handler closes this request's connection)
            return None
        statuses = [status for _, status, _, _ in found if status is not None]
        return (statuses[0], {}) if statuses else None

    def stall_gets(self, seconds: float) -> None:
        """Hold each GET's answer (already read from the server) this long."""
        self.stall = seconds

    def body_bytes(self, path: str) -> int:
        """Bytes of GET bodies sent so far for the object at `path` (bucket/key)."""
        with self._lock:
            return self.sent.get(path.lstrip("/"), 0)

    def next_fault(self, path: str, agent: str, auth: str):
        # "AWS4-HMAC-SHA256 Credential=KEY/DATE/REGION/s3/aws4_request, ..."
        scope = auth.partition("Credential=")[2].split(",")[0].split("/")
        with self._lock:
            self.gets.append((path, agent))
            self.regions.append(scope[2] if len(scope) > 2 else "")
            return self._faults.pop(0) if self._faults else None

    def __enter__(self) -> S3Front:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
