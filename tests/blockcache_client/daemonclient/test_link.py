"""DaemonLink's fill path against a real daemon: small fills go out on the
reader's thread, posted (no wait for the reply); big ones and anything behind
a queued job go through the filler thread, in order."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from blockcache_client.common.counters import Counters
from blockcache_client.contract import blockfile, fillarea, protocol
from blockcache_client.contract.blockkey import BlockKey
from blockcache_client.contract.errors import DaemonError
from blockcache_client.contract.protocol import ErrorCode
from blockcache_client.daemonclient import fillqueue
from blockcache_client.daemonclient.fillqueue import CALL_TIMEOUT, COLLECT_AFTER, INLINE_FILL_MAX
from blockcache_client.daemonclient.link import DaemonLink
from devtools.daemon import DaemonProcess
from tests.support.waiting import wait_for

VOLUME_KEY = bytes(32)


class SealRecorder:
    """The link's seal function, noting which thread sealed each key."""

    def __init__(self):
        self.threads: dict[str, str] = {}

    def __call__(self, key: str, plaintext: bytes, into: memoryview | None = None):
        self.threads[key] = threading.current_thread().name
        if into is None:
            return blockfile.seal(key, plaintext, VOLUME_KEY)
        return blockfile.seal_into(key, plaintext, VOLUME_KEY, buf=into)[0]

    def file_size(self, length: int) -> int:
        return blockfile.file_size(length, blockfile.DEFAULT_CHUNK)


def _key(i: int) -> str:
    return str(BlockKey("vol", i + 1, 0xabc, 0))


def _link(daemon, seal, **kw) -> DaemonLink:
    link = DaemonLink(daemon.socket_path, Counters(), seal, fill_queue_bytes=64 << 20, **kw)
    wait_for(lambda: link.connected, what="the link to connect")
    return link


def test_small_fills_are_sent_from_the_readers_thread_and_counted(daemon):
    seal = SealRecorder()
    link = _link(daemon, seal)
    try:
        # the fill connection is opened by the filler, never by a reader
        # (connect(2) can wait for a full accept backlog)
        first = _key(100)
        assert link.offer_fill(first, os.urandom(4096))
        assert link.wait_idle(10)
        assert seal.threads[first] == "blockcache-filler"
        small = [_key(i) for i in range(20)]
        for k in small:  # each alone: a tail the socket had no room for goes to the filler
            assert link.offer_fill(k, os.urandom(100 << 10))
            assert link.wait_idle(10)
        big = _key(99)
        assert link.offer_fill(big, os.urandom(INLINE_FILL_MAX + 1))
        assert link.wait_idle(10)
        me = threading.current_thread().name
        assert all(seal.threads[k] == me for k in small)
        assert seal.threads[big] == "blockcache-filler"
        # posted puts' replies were read and counted
        assert link._counters.snapshot()["fills_sent"] == 22
        assert link._filler_client.posted == 0
        daemon.wait_idle()
        paths = daemon.client().lookup(small + [big])
        assert all(paths)
    finally:
        link.close()


def test_inline_puts_read_their_replies_in_batches(daemon):
    # the control thread's nudge (every touch_interval) is kept out of the way
    seal = SealRecorder()
    link = _link(daemon, seal, touch_interval=600)
    try:
        assert link.offer_fill(_key(200), os.urandom(4096))  # opens the fill connection
        assert link.wait_idle(10)
        keys = [_key(i) for i in range(COLLECT_AFTER)]
        for k in keys:
            assert link.offer_fill(k, os.urandom(8 << 10))
            wait_for(lambda: link._tail is None and not link._busy, what="the put to go out")
        me = threading.current_thread().name
        assert all(seal.threads[k] == me for k in keys)
        # no put read a reply: each would have cost a poll and a recv
        assert link._filler_client.posted == COLLECT_AFTER
        assert link._counters.snapshot()["fills_sent"] == 1
        daemon.wait_idle()
        assert link.offer_fill(_key(300), os.urandom(8 << 10))  # reads those that arrived
        assert link._filler_client.posted == 1
        assert link._counters.snapshot()["fills_sent"] == 1 + COLLECT_AFTER
        assert link.wait_idle(10)
        assert link._counters.snapshot()["fills_sent"] == 2 + COLLECT_AFTER
    finally:
        link.close()


def test_an_eviction_and_the_refill_behind_it_stay_in_order(daemon):
    """An integrity eviction and the refill of the same key reach the daemon
    in order, whichever way each goes (queued, or sent from the reader's
    thread): the daemon ends up with the new block, not with none."""
    link = _link(daemon, SealRecorder())
    try:
        for round_ in range(20):
            k = _key(round_)
            assert link.offer_fill(k, os.urandom(4096))
            assert link.wait_idle(10)
            daemon.wait_idle()
            new = os.urandom(4096)
            link.evict_later(k)
            assert link.offer_fill(k, new)
            assert link.wait_idle(10)
            daemon.wait_idle()
            path = daemon.client().lookup([k])[0]
            assert path is not None, f"round {round_}: the refill was lost"
            with open(path, "rb") as f:
                assert blockfile.unseal(k, f.read(), VOLUME_KEY) == new
    finally:
        link.close()


def test_a_fill_to_a_daemon_that_died_is_counted_dropped_once(daemon):
    link = _link(daemon, SealRecorder())
    try:
        assert link.offer_fill(_key(1), os.urandom(4096))  # opens the fill connection
        assert link.wait_idle(10)
        daemon.proc.kill()
        daemon.proc.wait()
        before = link._counters.snapshot()
        assert link.offer_fill(_key(2), os.urandom(4096))  # inline: the socket is dead
        assert link.wait_idle(10)
        after = link._counters.snapshot()
        assert after["fills_dropped"] - before["fills_dropped"] == 1
        assert after["fills_sent"] == before["fills_sent"]
    finally:
        link.close()


def test_a_sealed_fill_says_done_only_once_its_bytes_are_sent(daemon):
    """`done` lets the tier reuse a block file's buffer: it must come after
    the last byte went out (or at once when the fill is not taken), never
    while the bytes are still queued or being sent."""
    link = DaemonLink(daemon.socket_path, Counters(), SealRecorder(),
                      fill_queue_bytes=16 << 20)
    wait_for(lambda: link.connected, what="the link to connect")
    done: list[str] = []
    key = _key(7)
    blob = blockfile.seal(key, os.urandom(8 << 20), VOLUME_KEY)  # more than a socket holds
    try:
        daemon.proc.send_signal(signal.SIGSTOP)  # the daemon reads nothing
        try:
            assert link.offer_fill(key, blob, sealed=True, done=lambda: done.append("big"))
            # already queued under that key: not taken, so done at once
            assert link.offer_fill(key, blob, sealed=True, done=lambda: done.append("again"))
            # over the queue's bound: dropped, so done at once
            assert not link.offer_fill(_key(8), blob, sealed=True,
                                       done=lambda: done.append("dropped"))
            time.sleep(0.3)  # the filler is blocked sending the first
            assert done == ["again", "dropped"]
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert link.wait_idle(10)
        assert done == ["again", "dropped", "big"]
        daemon.wait_idle()
        (path,) = daemon.client().lookup([key])
        with open(path, "rb") as f:
            assert f.read() == blob
    finally:
        link.close()


def test_an_eviction_the_daemon_refuses_is_counted(tmp_path):
    """A bad block whose eviction the daemon refuses (here: no peer may use
    the volume) stays in the cache: the reader's stats say so."""
    d = DaemonProcess(tmp_path, extra_args=["--unlisted-volumes", "admin", "--admin-uid", ""])
    try:
        d.start()
        link = _link(d, SealRecorder())
        try:
            link.evict_later(_key(1))
            assert link.wait_idle(10)
            assert link._counters.snapshot()["evictions_refused"] == 1
        finally:
            link.close()
    finally:
        d.stop()


def test_a_reader_of_another_protocol_version_is_refused_clearly(daemon, monkeypatch, caplog):
    theirs = protocol.PROTOCOL_VERSION
    monkeypatch.setattr(protocol, "PROTOCOL_VERSION", theirs + 1)
    with pytest.raises(DaemonError) as err:
        daemon.client().hello()
    assert err.value.code == ErrorCode.UNSUPPORTED_VERSION
    assert f"protocol version {theirs + 1} is not supported" in str(err.value)
    assert f"speaks version {theirs}: upgrade the older side" in str(err.value)
    # a volume's link keeps reading uncached, and says why once, as a warning
    with caplog.at_level(logging.WARNING, logger="blockcache_client.daemonclient.link"):
        link = DaemonLink(daemon.socket_path, Counters(), SealRecorder(), fill_queue_bytes=1 << 20)
        try:
            wait_for(lambda: any("upgrade the older side" in r.getMessage()
                                 for r in caplog.records), what="the version warning")
            time.sleep(0.5)  # several reconnects: still one warning
            assert not link.connected
            warned = [r for r in caplog.records if "upgrade" in r.getMessage()]
            assert len(warned) == 1 and daemon.socket_path in warned[0].getMessage()
        finally:
            link.close()


def test_opening_a_fill_area_holds_the_filler_one_timeout_on_a_stopped_daemon(daemon):
    """The area is asked for after the first sealed fill, once the posted
    puts are answered. If they are not (the daemon is stopped), the filler
    gives up there: no new connection and a second wait for the area."""
    link = _link(daemon, SealRecorder(), area_slot_bytes=1 << 20)
    try:
        assert link.offer_fill(_key(1), os.urandom(4096))  # opens the fill connection
        assert link.wait_idle(10)
        client = link._filler_client
        conn = client.connection_id
        key = _key(2)
        blob = blockfile.seal(key, os.urandom(4096), VOLUME_KEY)
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            assert link.offer_fill(key, blob, sealed=True)
            wait_for(lambda: not link._fills and not link._busy, timeout=4 * CALL_TIMEOUT,
                     what="the filler to be free")
            held = time.monotonic() - start
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert not client.connected and client.connection_id != conn  # given up, not retried
        assert client._connects == 1  # no connection was opened just to ask for the area
        assert held < 2 * CALL_TIMEOUT
        # later sealed fills open the area on the next connection
        key = _key(3)
        assert link.offer_fill(key, blockfile.seal(key, os.urandom(4096), VOLUME_KEY),
                               sealed=True)
        assert link.wait_idle(10)
        wait_for(lambda: link.take_slot(4096) is not None, what="a fill area")
    finally:
        link.close()


def test_blocks_from_the_source_are_sealed_into_the_fill_area(daemon):
    """The filler seals a put's block straight into a slot of the fill area
    and puts it by reference (the first put opens the connection, the next
    the area); the daemon's files are those blocks, and a block that fits no
    slot still goes by value."""
    size = 1 << 20
    link = _link(daemon, SealRecorder(), area_slot_bytes=blockfile.file_size(
        size, blockfile.DEFAULT_CHUNK))
    try:
        blocks = {_key(400 + i): os.urandom(size - i) for i in range(6)}
        too_big = _key(499), os.urandom(size + blockfile.DEFAULT_CHUNK)
        for key, data in [*blocks.items(), too_big]:
            assert link.offer_fill(key, data)
            assert link.wait_idle(10)
        daemon.wait_idle()
        assert daemon.client().stats()["fill_areas"]["puts"] >= len(blocks) - 1
        assert link._counters.snapshot()["fills_sent"] == len(blocks) + 1
        for key, data in [*blocks.items(), too_big]:
            (path,) = daemon.client().lookup([key])
            with open(path, "rb") as f:
                assert blockfile.unseal(key, f.read(), VOLUME_KEY) == data
    finally:
        link.close()


def test_with_every_slot_in_flight_the_filler_waits_for_one_not_by_value(daemon, monkeypatch):
    """A daemon behind on its writes holds every slot of the fill area. A
    block by value would cost it several times one from a slot (and keep it
    behind), so the filler waits for the daemon to free a slot."""
    monkeypatch.setattr(fillqueue, "SLOT_WAIT", 10.0)  # a loaded test host resumes slowly
    size = 1 << 20
    link = _link(daemon, SealRecorder(), area_slot_bytes=blockfile.file_size(
        size, blockfile.DEFAULT_CHUNK))
    try:
        for i in range(2):  # the first put opens the connection, the next the area
            assert link.offer_fill(_key(600 + i), os.urandom(size))
            assert link.wait_idle(10)
        area = link._area
        daemon.wait_idle()
        before = daemon.client().stats()["fill_areas"]["puts"]
        blocks = {_key(700 + i): os.urandom(size) for i in range(area.slots + 4)}
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            for key, data in blocks.items():
                assert link.offer_fill(key, data)
            wait_for(lambda: all(area._mm[i] == fillarea.SENT for i in range(area.slots)),
                     what="every slot put")
            time.sleep(0.05)  # the filler is waiting for a slot now
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert link.wait_idle(30)
        daemon.wait_idle()
        assert daemon.client().stats()["fill_areas"]["puts"] - before == len(blocks)
        for key, data in blocks.items():
            (path,) = daemon.client().lookup([key])
            with open(path, "rb") as f:
                assert blockfile.unseal(key, f.read(), VOLUME_KEY) == data
    finally:
        link.close()
