"""A squatter of another uid on a target's keeper control name gets nothing
from the plugin: a publish there fails naming the holder and mounts nothing;
a restarted plugin whose record it squats neither kills the pid it names nor
waits for it, and says why; unpublish removes the record and signals nothing.
A publish answers OK only with this volume's mount on the target (mountinfo)."""

from __future__ import annotations

import os
import subprocess

import grpc
import pytest

from fsclient import mountpoint as mp
from tests.support.keepers import kill_mount
from tests.support.squatter import squatting
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(180)]

INTRUDER = 12345


def test_a_squatted_target_is_never_published_and_its_pid_never_killed(world, plugin):
    target = world.target()
    with squatting(target, INTRUDER) as squatter:
        with pytest.raises(grpc.RpcError) as info:
            plugin.publish("vol-squat", target, world.context(), world.key)
        assert squatter.holder in info.value.details(), info.value.details()
        assert mp.find_mount(target) is None
        plugin.unpublish("vol-squat", target)  # nothing of ours there: OK
        assert squatter.harmless()


def test_a_restarted_plugin_neither_kills_nor_waits_for_a_squatter(world, keepers, tmp_path):
    ready = str(tmp_path / "ready")
    first = world.plugin(state="state-squat", name="squat-1").start()
    second = None
    target = world.target()
    try:
        first.publish("vol-dead", target, world.context(), world.key)
        first.stop()
        kill_mount(target)  # its keeper and server gone: a dead mount, still recorded
        with squatting(target, INTRUDER) as squatter:
            second = world.plugin(state="state-squat", name="squat-2",
                                  args=("--ready-file", ready)).start()
            wait_for(lambda: os.path.exists(ready), 60, "the plugin to be ready")
            assert squatter.holder in second.log()
            assert squatter.harmless()
            second.unpublish("vol-dead", target)
            assert squatter.harmless()
            assert not os.path.lexists(target) or mp.find_mount(target) is None
    finally:
        for p in (second, first):
            if p is not None:
                p.stop()
        print(first.log(), second.log() if second else "")  # shown on failure


def test_a_publish_is_ok_only_with_the_volumes_mount_on_the_target(world, plugin, tmp_path):
    """The host still has the target's keeper, but the target now shows another
    mount (a bind over it): a repeated publish answers an error naming what is
    there, not OK on the keeper's word; with the bind gone it answers OK."""
    target = world.target()
    plugin.publish("vol-covered", target, world.context(), world.key)
    cover = tmp_path / "cover"
    cover.mkdir()
    subprocess.run(["mount", "--bind", str(cover), target], check=True)
    try:
        with pytest.raises(grpc.RpcError) as info:
            plugin.publish("vol-covered", target, world.context(), world.key)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "not volume data's mount" in info.value.details(), info.value.details()
    finally:
        subprocess.run(["umount", target], check=True)
    plugin.publish("vol-covered", target, world.context(), world.key)
    assert mp.find_mount(target).source == "blockcache:data"
    plugin.unpublish("vol-covered", target)
    assert mp.find_mount(target) is None
