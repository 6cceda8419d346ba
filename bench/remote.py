"""The emulated remote: a moto S3 server on loopback, reached through a network delay.

Every system in the suite reads the same bucket through the same endpoint, so
their numbers differ only by what they do with the bytes.

Network delay: `probe_netem()` first checks whether `tc netem` works in a
throw-away network namespace (it does not in VMs whose kernel lacks
`sch_netem`, such as the reference machine) and the answer is recorded; the
delay itself always comes from `LatencyProxy`, a TCP proxy (asyncio, in its
own process so it never competes for the GIL of the process being measured)
that holds every chunk for half the round trip in each direction. Bandwidth
is not limited: the delay of a remote region, not its pipe. Connection set-up
is not charged: moto's server (werkzeug) closes the connection after every
response where real S3 keeps it alive, so charging a handshake would measure
moto's quirk, and every request would pay two round trips instead of one.

The proxy also counts what crossed it (connections, requests, bytes each way),
which gives every system, even those that expose nothing, a "bytes fetched from
the remote" figure per epoch. `Remote.method` and `Remote.note` record how
the delay was made and what the netem probe said.

Moto copies a whole object for every ranged GET, so large files are kept in
memory (`MOTO_S3_DEFAULT_KEY_BUFFER_SIZE`) and the datasets keep large objects
to tens of MiB (see `datasets.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from devtools.procs import stop_process
from devtools.s3server import S3Server

from . import PROJECT_ROOT

log = logging.getLogger(__name__)

ACCESS_KEY = "benchkey"
SECRET_KEY = "benchsecret"
REGION = "us-east-1"
DEFAULT_RTT_MS = 2.0
# HTTP methods a request starts with: counting chunks that begin with one
# approximates the request count (one request header is one write in practice).
_METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")
_CHUNK = 256 * 1024


# --- the latency proxy (runs in its own process: `python -m bench.remote proxy`) ---

@dataclass
class ProxyCounters:
    """What crossed the proxy since it started."""
    connections: int = 0
    requests: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                count, is_request: bool) -> None:
    """Copy reader -> writer, each chunk held until `delay` after it arrived.

    A reader task and a writer task joined by a queue, so a slow delay never
    stops the next chunk from being read (the link is a pipe, not a ping-pong).
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def read_side() -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                now = time.monotonic()
                queue.put_nowait((now + delay, data))
                if not data:
                    return
                count(data, is_request)
        except (ConnectionError, OSError):
            queue.put_nowait((0.0, b""))

    async def write_side() -> None:
        try:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            return

    rtask = asyncio.ensure_future(read_side())
    try:
        await write_side()
    finally:
        rtask.cancel()


async def serve_proxy(target: tuple[str, int], one_way: float, listen_port: int = 0,
                      control_port: int = 0, ready=None) -> None:
    """Forward 127.0.0.1:listen_port to `target`, delaying each direction by `one_way` s.

    A second port answers every connection with the counters as JSON and closes.
    `ready(port, control_port)` is called once both listen.
    """
    counters = ProxyCounters()
    # The loop holds tasks weakly and asyncio drops its reference to a
    # connection's handler when the peer closes: keep them alive until done.
    handlers: set[asyncio.Task] = set()

    def count(data: bytes, is_request: bool) -> None:
        if is_request:
            counters.bytes_up += len(data)
            if data.startswith(_METHODS):
                counters.requests += 1
        else:
            counters.bytes_down += len(data)

    async def handle(creader, cwriter) -> None:
        task = asyncio.current_task()
        handlers.add(task)
        try:
            await forward(creader, cwriter)
        finally:
            handlers.discard(task)

    async def forward(creader, cwriter) -> None:
        counters.connections += 1
        try:
            ureader, uwriter = await asyncio.open_connection(*target)
        except OSError as exc:
            log.warning("proxy cannot reach %s:%d: %s", target[0], target[1], exc)
            cwriter.close()
            return
        try:
            await asyncio.gather(
                _pump(creader, uwriter, one_way, count, True),
                _pump(ureader, cwriter, one_way, count, False))
        finally:
            for w in (uwriter, cwriter):
                w.close()

    async def control(_reader, writer) -> None:
        writer.write(json.dumps(counters.__dict__).encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, backlog=512)
    ctl = await asyncio.start_server(control, "127.0.0.1", control_port)
    if ready:
        ready(server.sockets[0].getsockname()[1], ctl.sockets[0].getsockname()[1])
    async with server, ctl:
        await asyncio.gather(server.serve_forever(), ctl.serve_forever())


class LatencyProxy:
    """The proxy process: `start()` returns once it listens; `counters()` reads its counts."""

    def __init__(self, target: tuple[str, int], rtt_ms: float = DEFAULT_RTT_MS):
        self.target = target
        self.rtt_ms = rtt_ms
        self.port = 0
        self.control_port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LatencyProxy:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.remote", "proxy", "--target",
             f"{self.target[0]}:{self.target[1]}", "--rtt-ms", str(self.rtt_ms)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=PROJECT_ROOT,
            text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            stop_process(self.proc)
            raise RuntimeError(f"latency proxy did not start (said {line!r}); run "
                               f"`python -m bench.remote proxy --target ...` to see why")
        self.port, self.control_port = map(int, line.split()[1:3])
        log.info("latency proxy %s -> %s:%d, rtt %.1f ms", self.endpoint, *self.target,
                 self.rtt_ms)
        return self

    def counters(self) -> dict:
        """Connections, requests (approximate) and bytes each way so far."""
        with socket.create_connection(("127.0.0.1", self.control_port), timeout=5) as s:
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        return json.loads(data)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


def probe_netem() -> str | None:
    """None when `tc netem` works in a network namespace here, else why not."""
    name = f"bcprobe{os.getpid()}"
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    except FileNotFoundError:
        return "iproute2 `ip` is not installed"
    if r.returncode:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo",
                            "root", "netem", "delay", "1ms"], capture_output=True, text=True)
        if r.returncode:
            return f"`tc qdisc add ... netem` failed: {r.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


# --- the whole remote ---

@dataclass
class Remote:
    """A running emulated remote: where to read (`endpoint`) and where to upload (`direct`)."""
    rtt_ms: float = DEFAULT_RTT_MS
    bucket: str = "bench"
    log_path: str | None = None
    method: str = ""
    note: str = ""
    moto: S3Server | None = None
    proxy: LatencyProxy | None = None

    def start(self) -> Remote:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        # moto copies a whole object per ranged GET: large ones stay in memory
        self.moto = S3Server(self.bucket, env={"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(256 << 20)},
                             log_path=self.log_path).start()
        log.info("moto server on %s (pid %d)", self.moto.endpoint_url, self.moto.proc.pid)
        why = probe_netem()
        # The proxy is used either way: its counters are how the suite sees
        # each system's remote traffic. The probe's answer is recorded so a
        # reader knows whether kernel-level delay was an option on this host.
        self.note = "tc netem works here; the proxy is used for its counters" if why is None \
            else f"tc netem unavailable: {why}"
        self.proxy = LatencyProxy(("127.0.0.1", self.moto.port), self.rtt_ms).start()
        self.method = f"latency proxy (user-space TCP, {self.rtt_ms:g} ms round trip)"

    def stop(self) -> None:
        for part in (self.proxy, self.moto):
            if part:
                part.stop()

    def __enter__(self) -> Remote:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """The delayed endpoint every system reads through."""
        return self.proxy.endpoint

    @property
    def direct(self) -> str:
        """The undelayed endpoint, for uploading datasets."""
        return self.moto.endpoint_url

    def storage_options(self, direct: bool = False) -> dict:
        """s3fs keyword arguments for this remote."""
        return {"key": ACCESS_KEY, "secret": SECRET_KEY,
                "endpoint_url": self.direct if direct else self.endpoint,
                "client_kwargs": {"region_name": REGION}}

    def env(self) -> dict:
        """Environment variables that point AWS SDK clients at the delayed endpoint."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": self.endpoint,
                "FSSPEC_S3_ENDPOINT_URL": self.endpoint, "FSSPEC_S3_KEY": ACCESS_KEY,
                "FSSPEC_S3_SECRET": SECRET_KEY}

    def counters(self) -> dict:
        return self.proxy.counters()


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.remote")
    sub = p.add_subparsers(dest="cmd", required=True)
    px = sub.add_parser("proxy", help="run the latency proxy in the foreground")
    px.add_argument("--target", required=True, help="HOST:PORT to forward to")
    px.add_argument("--rtt-ms", type=float, default=DEFAULT_RTT_MS)
    px.add_argument("--port", type=int, default=0)
    sub.add_parser("probe", help="say whether tc netem works here")
    args = p.parse_args(argv)
    if args.cmd == "probe":
        why = probe_netem()
        print("netem: usable" if why is None else f"netem: unusable: {why}")
        return
    host, _, port = args.target.rpartition(":")

    def ready(port_: int, ctl: int) -> None:
        print(f"READY {port_} {ctl}", flush=True)

    try:
        asyncio.run(serve_proxy((host, int(port)), args.rtt_ms / 2000.0, args.port, 0, ready))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    _main()
