"""An upgrade of the plugin's pod: a new plugin (same state dir, its own
socket and process group) finds every live mount kept by the keeper host at
its start, so the old plugin's whole container can then be killed while a
reader reading through the mount fails no read and reads no wrong byte. And
two plugins on one socket (a surge): the one that stops first leaves the
other's socket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress

import grpc
import pytest

from blockcache_csi.proto import csi_pb2, csi_pb2_grpc
from tests.support.fsclient_mounts import REPO
from tests.support.keepers import keeper_status
from tests.support.proc_files import mounts_under, status_of, wait_dead
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(180)]


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:  # between the unlink and the bind
        return None


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_new_plugin_keeps_the_mounts_and_the_old_one_may_die(world, keepers, tmp_path):
    ready = os.path.join(world.base, "takeover-new.ready")
    old = world.plugin(state="state-takeover", name="takeover-old").start()
    new = world.plugin(state="state-takeover", name="takeover-new", args=("--ready-file", ready))
    target = world.target()
    stop = str(tmp_path / "reader.stop")
    reader = None
    try:
        old.publish("vol-t", target, world.context("takeover"), world.key)
        before = keeper_status(target)
        reader = subprocess.Popen([sys.executable, "-m", "devtools.mountreader", target,
                                   world.source, stop, "--cwd", "dir0"], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: os.readlink(f"/proc/{reader.pid}/cwd") == os.path.join(target, "dir0"),
                 30, "the reader to start")
        time.sleep(0.5)
        assert not os.path.exists(ready)
        new.start()  # it listens, and is ready, once it has handled every mount
        after = keeper_status(target)
        assert open(ready).read() == f"{new.proc.pid}\n"
        assert (after["keeper"], after["server"]) == (before["keeper"], before["server"])
        assert status_of(after["keeper"])["PPid"] == str(keepers.pid)
        assert status_of(after["server"])["Uid"].split()[0] == "65534"
        # the old pod's container stops: every process in it, kill -9 at once
        with suppress(ProcessLookupError):
            os.killpg(old.proc.pid, signal.SIGKILL)
        _kill([old.proc.pid])
        wait_dead(old.proc.pid)
        time.sleep(1.0)
        open(stop, "w").close()
        out, err = reader.communicate(timeout=60)
        assert reader.returncode == 0, err.decode()
        tally = json.loads(out)
        assert tally["ok"] > 0 and tally["failed"] == {} and tally["wrong"] == 0, tally
        assert keeper_status(target)["keeper"] == after["keeper"]
        new.unpublish("vol-t", target)
        assert target not in mounts_under(os.path.dirname(target))
        new.stop()
        assert not os.path.exists(ready)
    finally:
        if reader is not None and reader.poll() is None:
            reader.kill()
            reader.wait(10)
        new.stop()
        old.stop()
        print(old.log(), new.log())  # shown when the test failed


def test_a_plugin_that_stops_leaves_its_successors_socket(world, keepers):
    """A surge update: the new plugin replaces the socket file while the old
    one serves; the old one, stopping, must not unlink the new one's."""
    first = world.plugin(state="state-surge", name="surge-first").start()
    second = world.plugin(state="state-surge", name="surge-second")
    second.socket, second.endpoint = first.socket, first.endpoint
    try:
        replaced = os.stat(first.socket).st_ino
        second.start()  # (its client may reach the first one's socket yet)
        wait_for(lambda: _inode(second.socket) not in (None, replaced), 30,
                 "the second plugin's socket")
        first.stop()
        assert os.path.exists(second.socket), first.log()
        with grpc.insecure_channel(second.endpoint) as channel:  # a new connection
            probe = csi_pb2_grpc.IdentityStub(channel).Probe(csi_pb2.ProbeRequest(), timeout=30)
        assert probe.ready.value
        second.stop()
        assert not os.path.exists(second.socket)  # its own: removed
    finally:
        second.stop()
        first.stop()


def test_a_keeper_its_mount_cannot_vouch_for_yet_is_asked_again(monkeypatch):
    """A keeper of the server's uid is trusted only when the mount names it; a
    mount too slow to answer (`fsclient.keeper.Unvouched`) makes it a keeper
    busy for now (`Unanswered`, a refusal), asked again, not a squatter to
    mount over. (The real Unvouched: tests/fsclient/keeper/test_keys.py.)"""
    from blockcache_csi.keepers import takeover
    from fsclient import keeper as fskeeper

    said = ("the control socket of /mnt/x is held by pid 7 uid 65534, a keeper only if the "
            "mount names it, and the mount did not answer in 5 s")

    def slow_mount(mountpoint: str, timeout: float) -> fskeeper.Surrendered:
        raise fskeeper.Unvouched(said)

    monkeypatch.setattr(fskeeper, "surrender", slow_mount)
    with pytest.raises(takeover.Unanswered) as exc:
        takeover.surrender_here("/mnt/x")
    assert str(exc.value) == said and isinstance(exc.value, takeover.Refused)
    assert takeover.refusal(exc.value) == "unanswered"  # (as the keeper host's wire says it)
    assert takeover.REFUSALS["unanswered"] is takeover.Unanswered


def test_a_silent_mount_is_asked_again_for_a_while_then_left_as_it_is(monkeypatch):
    """A restarted plugin asks again of a keeper its mount cannot vouch for
    yet (a loaded host), for `UNANSWERED_PATIENCE`: a mount that answers
    meanwhile is taken over; a hung one is left as it is, and the plugin
    gets ready instead of waiting for it forever. A publish is told to try
    again at once."""
    import threading
    from types import SimpleNamespace

    from blockcache_csi import mounts
    from blockcache_csi.errors import CsiError
    from blockcache_csi.keepers import Unanswered, takeover

    monkeypatch.setattr(mounts, "UNANSWERED_PATIENCE", 1.0)
    monkeypatch.setattr(takeover, "RETRY_FIRST", 0.05)
    monkeypatch.setattr(takeover, "RETRY_MAX", 0.2)
    no_host_keeper = SimpleNamespace(keeper_of=lambda target: None)
    plugin = mounts.Mounts(state=None, servers=None, socket=None, keepers=no_host_keeper)
    pub = SimpleNamespace(target="/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/v/mount")
    asked: list[float] = []
    answers: list = []

    def take_over(_pub) -> None:
        asked.append(time.monotonic())
        outcome = answers.pop(0) if answers else Unanswered("the mount did not answer in 5 s")
        if outcome is not None:
            raise outcome

    plugin._take_over = take_over
    # a slow mount: two silences, then it answers and is taken over
    answers[:] = [Unanswered("slow"), Unanswered("slow"), None]
    assert plugin._keep(pub, patient=True) is True and len(asked) == 3

    # a hung mount: asked again until the patience is spent, then left
    asked.clear()
    kept: list[float] = []

    def keep() -> None:
        start = time.monotonic()
        assert plugin._keep(pub, patient=True) is True
        kept.append(time.monotonic() - start)

    worker = threading.Thread(target=keep, daemon=True)
    worker.start()
    worker.join(30)
    assert kept, "the plugin waited on a hung mount for good"
    assert len(asked) >= 3 and kept[0] >= 1.0  # (asked again until the patience was spent)

    with pytest.raises(CsiError) as refused:
        plugin._keep(pub, patient=False)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert "try again" in refused.value.message
