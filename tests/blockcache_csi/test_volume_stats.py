"""NodeGetVolumeStats: an answer within its deadline whatever the mount's
server does, on threads of its own (a hung mount never stalls a publish),
VOLUME_CONDITION abnormal for a hung or dead mount, and no inode figures
when the mount knows none (blockcache's statfs gives no free count, which
inode alerts would read as "full")."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from blockcache_csi.proto import csi_pb2
from blockcache_csi.volstats import DEADLINE, StatfsWithDeadline
from tests.support.keepers import keeper_status, kill_mount
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(120)]
RPC = csi_pb2.NodeServiceCapability.RPC
SLACK = 3.0  # gRPC and a loaded machine, over the deadline


def stop(pid: int) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped (a thread
    busy when the signal came may still answer a request until then)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        tasks = os.listdir(f"/proc/{pid}/task")
        return all(open(f"/proc/{pid}/task/{t}/stat").read().rpartition(")")[2].split()[0]
                   in ("T", "t") for t in tasks)

    wait_for(stopped, 30, f"every thread of {pid} to stop")


def stats(plugin, volume_id: str, target: str):
    return plugin.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=volume_id, volume_path=target), timeout=60)


def timed(call):
    start = time.monotonic()
    out = call()
    return out, time.monotonic() - start


def test_volume_condition_is_advertised(plugin):
    caps = plugin.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest())
    assert {c.rpc.type for c in caps.capabilities} == {RPC.GET_VOLUME_STATS,
                                                       RPC.VOLUME_CONDITION}


def test_a_hung_mount_answers_abnormal_in_time_and_publishes_go_on(world, plugin):
    hung, beside, after = world.target(), world.target(), world.target()
    plugin.publish("vol-hung", hung, world.context("hung"), world.key)
    healthy = stats(plugin, "vol-hung", hung)
    assert not healthy.volume_condition.abnormal, healthy.volume_condition.message
    # bytes only: blockcache's statfs has no inode figures to give
    assert [u.unit for u in healthy.usage] == [csi_pb2.VolumeUsage.BYTES]
    server = keeper_status(hung)["server"]
    try:
        stop(server)  # its statfs now waits in the kernel
        with ThreadPoolExecutor(16) as pool:
            first = pool.submit(timed, lambda: stats(plugin, "vol-hung", hung))
            # a publish beside it, while the stats call waits out its deadline
            # (a stalled publish would end in the client's DEADLINE_EXCEEDED)
            plugin.publish("vol-beside", beside, world.context("beside"), world.key)
            answer, waited = first.result(timeout=60)
            assert answer.volume_condition.abnormal
            assert "has not answered statfs" in answer.volume_condition.message
            assert waited < DEADLINE + SLACK, waited
            assert [u.total for u in answer.usage] == [0]  # nothing known, nothing "full"
            # more stats calls than gRPC workers on the hung mount: each answers at
            # once (its statfs is already late), and a publish goes through meanwhile
            many = [pool.submit(timed, lambda: stats(plugin, "vol-hung", hung))
                    for _ in range(12)]
            plugin.publish("vol-after", after, world.context("after"), world.key)
            for f in many:
                answer, waited = f.result(timeout=60)
                assert answer.volume_condition.abnormal and waited < SLACK, waited
        assert not stats(plugin, "vol-beside", beside).volume_condition.abnormal
    finally:
        os.kill(server, signal.SIGCONT)
    # the server answers again: so does the stats call
    wait_for(lambda: not stats(plugin, "vol-hung", hung).volume_condition.abnormal, 30,
             "the resumed mount to answer statfs")
    for vid, target in (("vol-hung", hung), ("vol-beside", beside), ("vol-after", after)):
        plugin.unpublish(vid, target)


def test_statfs_threads_are_bounded_per_target_and_in_all(world, plugin):
    hung, other = world.target(), world.target()
    plugin.publish("vol-bound", hung, world.context("bound"), world.key)
    plugin.publish("vol-other", other, world.context("other"), world.key)
    server = keeper_status(hung)["server"]
    calls = StatfsWithDeadline(deadline=1.0, limit=1)
    try:
        stop(server)
        for _ in range(5):
            assert calls.usage(hung).abnormal
        assert calls.outstanding() == 1  # one thread waits on the hung mount, not five
        # the limit reached, a healthy mount is not asked (no sixth thread)
        refused = calls.usage(other)
        assert refused.abnormal and "have not returned" in refused.message
        assert calls.outstanding() == 1
    finally:
        os.kill(server, signal.SIGCONT)
    wait_for(lambda: calls.outstanding() == 0, 30, "the stuck statfs to return")
    wait_for(lambda: not calls.usage(other).abnormal, 30, "the healthy mount to answer")
    plugin.unpublish("vol-bound", hung)
    plugin.unpublish("vol-other", other)


def test_a_dead_mount_is_abnormal(world, plugin):
    target = world.target()
    plugin.publish("vol-dead", target, world.context("dead"), world.key)
    kill_mount(target)
    answer, waited = timed(lambda: stats(plugin, "vol-dead", target))
    assert answer.volume_condition.abnormal and waited < SLACK
    assert "is dead" in answer.volume_condition.message
    plugin.unpublish("vol-dead", target)
    assert not os.path.exists(target)
