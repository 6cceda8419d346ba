"""The keeper host's table (`keepers.children.Children`) never lists a keeper
that has ended as serving, reaped or not: a keeper killed a moment before a
plugin asks is a zombie until the reaper's next turn, and a plugin that
heard it was serving took its dead mount for kept and left it dead."""

from __future__ import annotations

import os
import signal
import subprocess

from blockcache_csi.keepers.cgroups import KeeperCgroups
from blockcache_csi.keepers.children import Child, Children
from tests.support.waiting import wait_for


def _ended_unreaped(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def test_a_keeper_killed_and_not_yet_reaped_is_not_listed_as_serving(tmp_path):
    table = Children(KeeperCgroups(0))  # (no cgroup is made: none is set up)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        child = Child(str(tmp_path / "m"), "s3://b", ["fsclient"], {}, pid=proc.pid,
                      ready=True, proc=proc)
        with table._lock:  # as `spawn` enters a keeper that became ready
            table._by_pid[proc.pid] = child
        assert [k["ready"] for k in table.listing()] == [True]
        assert table.serving(child.mountpoint) is child
        os.kill(proc.pid, signal.SIGKILL)
        wait_for(lambda: _ended_unreaped(proc.pid), 10, "the keeper's end")
        # a zombie now: the reaper has not run, and the table still holds it
        assert table.get(proc.pid) is child and child.code is None
        assert [k["ready"] for k in table.listing()] == [False]
        assert table.serving(child.mountpoint) is None
        assert _ended_unreaped(proc.pid)  # looked at, left for the reaper
    finally:
        proc.kill()
        proc.wait()
