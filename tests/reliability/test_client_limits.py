"""What one socket client can take from the others, with a real daemon:
evictions sent during a rebuild, connections, reply bytes, the fill queue,
`list` pages and per-volume state. Each test has a bystander client that
must keep being answered."""

from __future__ import annotations

import os
import resource
import signal
import socket
import threading
import time

import pytest

from blockcache_client.contract import blockfile, layout, protocol
from blockcache_client.contract.blockkey import BlockKey
from blockcache_client.contract.errors import DaemonError, DaemonUnavailable
from blockcache_client.daemonclient.client import Client
from blockcached.config import Config
from blockcached.connlimits import ADMIN_RESERVED, MAX_CONNECTIONS
from devtools.daemon import DaemonProcess
from tests.support.faultyfs import FaultyMount
from tests.support.figures import record
from tests.support.pipeline import pipeline
from tests.support.skips import needs_fuse, needs_root
from tests.support.uids import as_nobody, socket_group

# a pause this long means the loop ran one long job: today's matcher list made
# 1.66 s pauses with 5,000 evicts; the set costs milliseconds per 5k chunk
PAUSE_BOUND = 1.0


class PingProbe:
    """A bystander pinging the daemon every 10 ms on its own connection,
    keeping the longest wait for a reply (the event loop's longest pause)."""

    def __init__(self, socket_path: str):
        self.client = Client(socket_path, timeout=30)
        self.worst = 0.0
        self.pings = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            self.client.ping()
            self.worst = max(self.worst, time.monotonic() - t)
            self.pings += 1
            self._stop.wait(0.01)

    def __enter__(self) -> PingProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()


def _plant_blocks(cache: str, keys: list[str], tmp_junk: int) -> None:
    """Block-sized files under the keys' paths (the scan reads names and
    sizes, not contents), and `tmp_junk` leftover temp files, whose removal
    at start-up keeps the rebuild running while the evictions arrive."""
    blob = b"\0" * (blockfile.HEADER_SIZE + blockfile.TAG_SIZE + 16)
    for k in keys:
        p = os.path.join(cache, layout.block_relpath(k))
        try:
            f = open(p, "wb")
        except FileNotFoundError:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            f = open(p, "wb")
        with f:
            f.write(blob)
    tmp = os.path.join(cache, "tmp")
    os.makedirs(tmp, exist_ok=True)
    for i in range(tmp_junk):
        open(os.path.join(tmp, f"junk.{i}"), "wb").close()


def test_evictions_during_a_rebuild_do_not_freeze_the_loop(tmp_path):
    n_blocks, n_evicts = 20_000, 10_000
    keys = [str(BlockKey("vol", 1000 + i, 0xabc, 0)) for i in range(n_blocks)]
    d = DaemonProcess(tmp_path)
    _plant_blocks(d.cache_dirs[0], keys, tmp_junk=80_000)
    d.start(wait_rebuilt=False)
    try:
        with PingProbe(d.socket_path) as probe:
            c = d.client(timeout=60)
            evicted = keys[::2][:n_evicts]
            replies = []
            for start in range(0, len(evicted), 1000):
                replies += pipeline(c, [("evict", {"key": k}) for k in evicted[start:start + 1000]])
            during = c.stats()["rebuild"]["state"] == "running"
            # and one inode's blocks by prefix
            c.evict(inode=("vol", 1001))
            s = d.wait_rebuilt(timeout=120)
        assert all(r["ok"] for r in replies)
        assert during, "the rebuild ended before the evictions were sent: plant more tmp junk"
        assert sum(r["evicted"] == 0 for r in replies) == n_evicts  # none was indexed yet
        # each eviction was applied to what the scan found
        left = set(c.list_all())
        want = set(keys[1::2]) - {keys[1]}
        assert not left - want, sorted(left - want)[:5]
        assert left == want, (len(left), len(want), s["rebuild"], s["entries"])
        assert s["entries"] == len(left)
        assert probe.pings > 10
        assert probe.worst < PAUSE_BOUND, f"the loop paused {probe.worst:.2f} s"
        record("evictions_during_rebuild", blocks=n_blocks, evicts=n_evicts,
               worst_ping_s=round(probe.worst, 3), pings=probe.pings,
               rebuild_s=s["rebuild"]["seconds"])
    finally:
        d.stop()


def _bystander(path: str) -> dict:
    """Another tenant (uid nobody) at the same moment: answered in full."""
    with Client(path, timeout=10) as c:
        t = time.monotonic()
        c.ping()
        page = c.list(None, protocol.LIST_PAGE)
        return {"ping_s": time.monotonic() - t, "keys": len(page["keys"]),
                "truncated": page["truncated"]}


@needs_root
def test_connections_reply_bytes_and_list_pages_per_uid(tmp_path, shared_dir):
    n_blocks = 12_000
    keys = sorted(str(BlockKey("vol", 1000 + i, 0xabc, 0)) for i in range(n_blocks))
    d = DaemonProcess(tmp_path, cache_dirs=[(os.path.join(shared_dir, "cache"), "1G")],
                      extra_args=["--socket-group", str(socket_group()),
                                  "--max-connections-per-uid", "16",
                                  "--max-reply-bytes-per-uid", "2M"])
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    _plant_blocks(d.cache_dirs[0], keys, tmp_junk=0)
    d.start()
    hogs: list[socket.socket] = []
    try:
        c = d.client(timeout=30)
        # list is paginated: a page at most, the rest with `after`
        with pytest.raises(DaemonError) as err:
            c.list(None, protocol.LIST_PAGE + 1)
        assert err.value.code == "bad_request"
        first = c.list(None, protocol.LIST_PAGE)
        assert len(first["keys"]) == protocol.LIST_PAGE and first["truncated"]
        assert c.list_all() == keys
        # uid 0 opens 15 more connections (16 with `c`) that ask for pages and never read
        request = b"".join(protocol.encode_frame({"id": i + 1, "op": "list", "volume": None,
                                                  "limit": protocol.LIST_PAGE}) for i in range(2))
        for _ in range(15):
            s = socket.socket(socket.AF_UNIX)
            s.connect(d.socket_path)
            s.sendall(request)
            hogs.append(s)
        s = d.wait_stats(lambda s: s["refused"].get("reply_bytes", 0) > 0, timeout=30, client=c)
        # a 17th connection of uid 0 is refused; its replies so far stay unread
        with pytest.raises(DaemonUnavailable):
            Client(d.socket_path, timeout=5).ping()
        with pytest.raises(DaemonError) as err:
            c.list(None, protocol.LIST_PAGE)  # uid 0 is over its unread reply bytes
        assert err.value.code == "busy"
        # another uid is unaffected, meanwhile
        other = as_nobody(_bystander, d.socket_path, gid=socket_group())
        assert other["keys"] == protocol.LIST_PAGE and other["truncated"]
        s = c.stats()
        assert s["refused"]["connections"] >= 1 and s["refused"]["reply_bytes"] >= 1
        assert "refused uid 0" in d.stderr()
        for h in hogs:
            h.close()
        hogs.clear()
        d.wait_stats(lambda s: s["connections"] <= 2, client=c)
        assert len(c.list(None, protocol.LIST_PAGE)["keys"]) == protocol.LIST_PAGE
        record("per_uid_connections_and_replies", connections_limit=16,
               refused_connections=s["refused"]["connections"],
               refused_replies=s["refused"]["reply_bytes"],
               bystander_ping_s=round(other["ping_s"], 3), list_page=protocol.LIST_PAGE)
    finally:
        for h in hogs:
            h.close()
        d.stop()


def _put_one(path: str, key: str) -> str:
    with Client(path, timeout=10) as c:
        return c.put(key, blockfile.seal(key, b"z" * 1000, bytes(32)))[1]


@needs_fuse
def test_fill_queue_share_per_uid(tmp_path, shared_dir):
    """One uid's puts fill its share of the queue, not the queue: with the
    cache disk hung (nothing gets written), uid 0 is refused `over_share`
    while uid nobody's put is still queued."""
    fm = FaultyMount(str(tmp_path / "real"), str(tmp_path / "faulty"))
    d = DaemonProcess(tmp_path, cache_dirs=[(tmp_path / "faulty", "64M")],
                      extra_args=["--socket-group", str(socket_group()), "--io-timeout", "60",
                                  "--fill-queue-bytes", "4M", "--fill-queue-share", "0.25"])
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    try:
        fm.start()
        d.start()
        fm.set_mode("hang")
        c = d.client(timeout=10)
        reasons = []
        for i in range(8):  # 256 KiB blocks: the share of 1 MiB holds 3
            k = str(BlockKey("hog", 1 + i, 1, 0))
            reasons.append(c.put(k, blockfile.seal(k, b"h" * (256 << 10), bytes(32)))[1])
        assert reasons == ["queued"] * 3 + ["over_share"] * 5, reasons
        assert as_nobody(_put_one, d.socket_path, str(BlockKey("other", 1, 1, 0)),
                         gid=socket_group()) == "queued"
        s = c.stats()
        assert s["put_results"]["over_share"] == 5 and s["refused"]["over_share"] == 5
        assert s["queue"]["entries"] == 4
        fm.set_mode("ok")
        d.wait_idle(timeout=30)
        record("fill_queue_share", share_bytes=1 << 20, hog_queued=3, hog_refused=5,
               other_uid="queued")
    finally:
        fm.stop()  # releases hung operations first
        d.stop()


_PING = protocol.encode_frame({"id": 1, "op": "ping"})


def _answered(s: socket.socket) -> bool:
    """Whether a ping on `s` is answered (a refused connection is closed)."""
    try:
        s.sendall(_PING)
        head = s.recv(4)
        return len(head) == 4 and len(s.recv(protocol.frame_length(head))) > 0
    except OSError:
        return False


class Hog:
    """A child as `uid` (in the socket's group) holding as many connections
    as the daemon grants it, up to `most`, each answered a ping, until closed."""

    def __init__(self, path: str, uid: int, most: int = 2000):
        r, w = os.pipe()
        self._release_r, self._release = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # child: never returns into pytest
            try:
                os.close(r)
                os.close(self._release)
                resource.setrlimit(resource.RLIMIT_NOFILE, (most + 64, most + 64))
                os.setgroups([])
                os.setgid(socket_group())
                os.setuid(uid)
                held = []
                while len(held) < most:
                    s = socket.socket(socket.AF_UNIX)
                    s.settimeout(10)
                    try:
                        s.connect(path)
                    except OSError:
                        break
                    if not _answered(s):
                        s.close()
                        break
                    held.append(s)
                os.write(w, str(len(held)).encode())
                os.close(w)
                os.read(self._release_r, 1)  # until the parent closes its end
            finally:
                os._exit(0)
        os.close(w)
        os.close(self._release_r)
        with os.fdopen(r, "rb") as f:
            self.held = int(f.read() or 0)

    def close(self) -> None:
        os.close(self._release)
        os.kill(self.pid, signal.SIGKILL)  # later hogs hold copies of `_release` too
        os.waitpid(self.pid, 0)


@needs_root
def test_four_uids_at_their_cap_leave_root_and_a_fifth_uid_room(tmp_path, shared_dir):
    """With the defaults: each uid holds max_connections_per_uid, and the
    last ADMIN_RESERVED of the daemon's connections are for admins only.
    Before: 1,024 per uid, so four uids took all 4,096 and refused root."""
    d = DaemonProcess(tmp_path, cache_dirs=[(os.path.join(shared_dir, "cache"), "64M")],
                      extra_args=["--socket-group", str(socket_group())])
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    d.start()
    hogs: list[Hog] = []
    try:
        cap = Config.__dataclass_fields__["max_connections_per_uid"].default
        for uid in range(60001, 60005):
            hogs.append(Hog(d.socket_path, uid))
        assert [h.held for h in hogs] == [cap] * 4
        # a fifth uid gets its whole share, and fills what non-admins may hold
        hogs.append(Hog(d.socket_path, 60005))
        assert hogs[-1].held == cap
        sixth = Hog(d.socket_path, 60006)
        hogs.append(sixth)
        assert sixth.held == MAX_CONNECTIONS - ADMIN_RESERVED - 5 * cap
        # root, an admin, still connects
        t = time.monotonic()
        with Client(d.socket_path, timeout=10) as c:
            assert c.ping()["ok"]
            s = c.stats()
        record("connections_four_uids", per_uid=cap, uids=len(hogs),
               held=sum(h.held for h in hogs), root_ping_s=round(time.monotonic() - t, 3))
        assert s["refused"]["connections"] >= 6
    finally:
        for h in hogs:
            h.close()
        d.stop()


@needs_root
def test_a_connection_that_sends_nothing_or_half_a_prefix_is_closed(tmp_path):
    d = DaemonProcess(tmp_path, extra_args=["--frame-timeout", "1s"])
    d.start()
    socks = {name: socket.socket(socket.AF_UNIX) for name in ("silent", "half", "answered")}
    try:
        for s in socks.values():
            s.settimeout(10)
            s.connect(d.socket_path)
        socks["half"].sendall(_PING[:2])
        assert _answered(socks["answered"])  # a request completed: idle is fine
        t = time.monotonic()
        assert socks["silent"].recv(1) == b""  # closed by the daemon
        assert socks["half"].recv(1) == b""
        took = time.monotonic() - t
        record("connections_never_finishing", frame_timeout_s=1, closed_after_s=round(took, 2))
        assert 0.5 < took < 5, took
        time.sleep(0.5)
        assert _answered(socks["answered"])
    finally:
        for s in socks.values():
            s.close()
        d.stop()
