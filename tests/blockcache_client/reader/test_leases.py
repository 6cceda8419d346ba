"""Many readers, one fetch: `Volume` readers in processes of their own read
one cold file at once through a real daemon, from moto S3 behind a front
that counts the bytes it serves (and can hold GETs back), so each block is
fetched once on the host; and a holder that dies, never fills, or loses
its daemon costs the others at most the bound."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time

import pytest

from blockcache_client import Volume
from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess
from tests.blockcache_client.conftest import S3Source
from tests.support.leasereaders import Readers
from tests.support.s3front import S3Front
from tests.support.volumes import block_key
from tests.support.waiting import wait_for

BS = 1 << 20
SIZE = 24 * BS + 12345  # 25 blocks: a window's parts (8 blocks) and a short last block


@pytest.fixture
def front(s3_server):
    with S3Front(s3_server.endpoint_url) as f:
        yield f


@pytest.fixture
def cold_file(s3_server):
    src = S3Source(s3_server)
    data = os.urandom(SIZE)
    src.write("f.bin", data)
    return src, data


def _daemon(tmp_path, lease_timeout: str) -> DaemonProcess:
    return DaemonProcess(tmp_path, extra_args=["--lease-timeout", lease_timeout]).start()


def _readers(rs: Readers, n: int, src: S3Source, front: S3Front, key_file: str,
             d: DaemonProcess, **options) -> list[int]:
    opts = dict(src.options, endpoint_url=front.url, **options)
    return [rs.volume("vol", src.url, key_file, d.socket_path, opts, "f.bin", BS)
            for _ in range(n)]


def _served(front: S3Front, src: S3Source) -> int:
    return front.body_bytes(f"{src.base}/f.bin")


def _leases(d: DaemonProcess) -> dict:
    return d.client().stats()["leases"]


def test_four_processes_reading_one_cold_file_fetch_each_block_once(
        tmp_path, front, cold_file, key_file):
    src, data = cold_file
    d = _daemon(tmp_path, "30")  # no wait may expire under load: each block once, exactly
    try:
        with Readers() as rs:
            _readers(rs, 4, src, front, key_file, d)
            rs.wait_ready()
            rs.go()
            got = rs.results(timeout=90)
        want = hashlib.sha256(data).hexdigest()
        assert [r["sha"] for r in got] == [want] * 4
        assert _served(front, src) == SIZE  # every block fetched once, by one of them
        blocks = -(-SIZE // BS)
        assert sum(r["stats"]["leases_taken"] for r in got) == blocks
        assert sum(r["stats"]["backend_bytes"] for r in got) == SIZE
        saved = sum(r["stats"]["lease_saved"] for r in got)
        assert saved >= 1 and sum(r["stats"]["lease_gave_up"] for r in got) == 0
        le = _leases(d)
        assert le["taken"] == blocks and le["saved"] == saved and le["held"] == 0
        assert le["expired"] == le["lost"] == le["declined"] == 0
    finally:
        d.stop()


def test_a_holder_killed_mid_fetch_leaves_its_waiters_to_fetch_at_once(
        tmp_path, front, cold_file, key_file):
    src, data = cold_file
    d = _daemon(tmp_path, "60")  # a wait left to expire would outlast the test
    try:
        with Readers() as rs:
            # no windows (a memory cache of 2 blocks): each waits for one block at a time
            holder, *waiters = _readers(rs, 3, src, front, key_file, d,
                                        memory_cache_bytes=2 * BS)
            rs.wait_ready()
            front.stall_gets(60)  # the holder's GETs hang in the front
            rs.go([holder])
            wait_for(lambda: _leases(d)["held"] >= 1, what="the holder's leases")
            rs.go(waiters)
            wait_for(lambda: _leases(d)["waiting"] == 2, what="two readers waiting")
            front.stall_gets(0)
            rs.kill(holder)
            killed = time.monotonic()
            got = rs.results(waiters, timeout=30)
            after_kill = time.monotonic() - killed
        assert [r["sha"] for r in got] == [hashlib.sha256(data).hexdigest()] * 2
        assert after_kill < 20, after_kill  # well within the 60 s bound: no wait expired
        assert all(r["stats"]["lease_gave_up"] >= 1 for r in got)
        le = _leases(d)
        assert le["lost"] >= 1 and le["expired"] == 0
    finally:
        d.stop()


def _hold_every_block(d: DaemonProcess, keys: list[str], bound: float,
                      stop: threading.Event) -> None:
    """A holder that never fills: it leases every block of the file, and
    leases each again as soon as it expires, until `stop`. Block i+1 is
    leased a little before block i, so a reader that waited for block i
    to expire would find block i+1 leased anew: nearly a bound per block."""
    c = d.client()
    step = 0.05
    now = time.monotonic()
    due = [now + (len(keys) - i) * step for i in range(len(keys))]
    while not stop.is_set():
        now = time.monotonic()
        for i, key in enumerate(keys):
            if now >= due[i]:
                c.lease([key])
                due[i] += bound + 0.01
        stop.wait(0.005)


def _file_keys(src: S3Source, key_file: str) -> list[str]:
    with Volume("vol", src.url, key_file, socket_path="/nonexistent.sock", block_size=BS,
                **src.options) as vol:
        return [block_key(vol, "f.bin", off) for off in range(0, SIZE, BS)]


def test_a_holder_that_never_fills_costs_a_reader_the_bound_once(
        tmp_path, front, cold_file, key_file):
    src, data = cold_file
    bound = 2.0
    d = _daemon(tmp_path, str(bound))
    stop = threading.Event()
    blocks = -(-SIZE // BS)
    hostile = threading.Thread(target=_hold_every_block,
                               args=(d, _file_keys(src, key_file), bound, stop))
    try:
        with Readers() as rs:
            # one block at a time (no windows: a memory cache of 2 blocks)
            _readers(rs, 1, src, front, key_file, d, memory_cache_bytes=2 * BS)
            rs.wait_ready()
            hostile.start()
            wait_for(lambda: _leases(d)["held"] == blocks, what="every block leased")
            rs.go()
            (got,) = rs.results(timeout=120)
        assert got["sha"] == hashlib.sha256(data).hexdigest()
        # it waited for its first block until its lease expired, then fetched
        # every block without waiting again: waiting for each would cost it
        # nearly a bound a block (50 s)
        st = got["stats"]
        assert st["lease_waits"] == st["lease_gave_up"] == 1 and st["lease_saved"] == 0
        assert got["seconds"] < bound + 5, got["seconds"]
        assert _leases(d)["expired"] >= blocks
    finally:
        stop.set()
        if hostile.is_alive():
            hostile.join(10)
        d.stop()


def _waiting_reader(rs: Readers, src: S3Source, front: S3Front, key_file: str,
                    d: DaemonProcess) -> None:
    """A reader started on a file whose every block another connection holds
    (and never fills), once it waits for one."""
    _readers(rs, 1, src, front, key_file, d)
    rs.wait_ready()
    d.client().lease(_file_keys(src, key_file))
    rs.go()
    wait_for(lambda: _leases(d)["waiting"] >= 1, what="the reader waiting")


def test_the_daemon_killed_during_a_wait_leaves_reads_to_the_remote(
        tmp_path, front, cold_file, key_file):
    src, data = cold_file
    d = _daemon(tmp_path, "60")
    try:
        with Readers() as rs:
            _waiting_reader(rs, src, front, key_file, d)
            d.kill()
            killed = time.monotonic()
            (got,) = rs.results(timeout=30)
            after_kill = time.monotonic() - killed
        assert got["sha"] == hashlib.sha256(data).hexdigest()
        assert after_kill < 20, after_kill
        assert got["stats"]["lease_waits"] == got["stats"]["lease_gave_up"] >= 1
        assert got["stats"]["backend_bytes"] == SIZE == _served(front, src)
    finally:
        d.stop()


def test_a_hung_daemon_costs_a_wait_its_bound_and_no_more(tmp_path, front, cold_file,
                                                          key_file):
    src, data = cold_file
    bound = 3.0
    d = _daemon(tmp_path, str(bound))
    try:
        with Readers() as rs:
            _waiting_reader(rs, src, front, key_file, d)
            d.proc.send_signal(signal.SIGSTOP)  # it answers nothing, the wait included
            try:
                (got,) = rs.results(timeout=60)
            finally:
                d.proc.send_signal(signal.SIGCONT)
        assert got["sha"] == hashlib.sha256(data).hexdigest()
        # the wait gave up at the bound and 1 s more; the rest came from the
        # remote, with a lease request or two waiting 1 s before the link saw
        # the daemon gone
        assert got["seconds"] < bound + 1 + 4, got["seconds"]
        assert got["stats"]["lease_waits"] == got["stats"]["lease_gave_up"] >= 1
        assert got["stats"]["backend_bytes"] == SIZE
    finally:
        d.stop()


def test_two_volumes_with_different_keys_over_one_source_share_nothing(
        tmp_path, front, cold_file, key_file):
    src, data = cold_file
    other_key = str(tmp_path / "other.key")
    generate_key_file(other_key)
    d = _daemon(tmp_path, "30")
    try:
        with Readers() as rs:
            opts = dict(src.options, endpoint_url=front.url)
            for k in (key_file, other_key):  # one volume name, one source, two keys
                rs.volume("vol", src.url, k, d.socket_path, opts, "f.bin", BS)
            rs.wait_ready()
            rs.go()
            got = rs.results(timeout=90)
        assert [r["sha"] for r in got] == [hashlib.sha256(data).hexdigest()] * 2
        blocks = -(-SIZE // BS)
        # each leased and fetched every block of its own: no waits across keys
        assert [r["stats"]["leases_taken"] for r in got] == [blocks, blocks]
        assert [r["stats"]["lease_waits"] for r in got] == [0, 0]
        assert _served(front, src) == 2 * SIZE
    finally:
        d.stop()
