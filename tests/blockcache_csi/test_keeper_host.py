"""The keeper host keeps every mount whatever happens to the plugin's
container: the plugin as PID 1 of its own pid namespace killed with SIGKILL,
or its whole cgroup killed (`cgroup.kill`, what the kubelet's
memory.oom.group=1 does on an OOM), while readers read and verify bytes
through two mounts: no read fails, and the next plugin finds the mounts kept.
One server past its cgroup's memory limit is OOM-killed alone. A new keeper
host takes every keeper of the old one over (a busy one too, and a publish
that raced it) before it is ready, and the old one's whole pid namespace may
then die. A keeper killed alone is taken back by the host; a plugin keeps
asking a keeper not the host's that refuses to surrender.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time
import uuid
from contextlib import ExitStack, suppress

import grpc
import pytest

from blockcache_csi.keepers import HostError
from blockcache_csi.keepers import KeeperHost as HostClient
from fsclient.mountpoint import MountError
from tests.support.csi_plugin import pid_one, running
from tests.support.keepers import Busy, Reader, keeper_status, keepers_under, pids
from tests.support.proc_files import children_of, mounts_under, status_of, wait_dead
from tests.support.uids import NOBODY
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(240)]
UNSHARE = ("unshare", "--pid", "--fork", "--kill-child")
INTRUDER = 12345  # a uid with nothing of ours
UNIFIED = "/sys/fs/cgroup/unified"


def _reading(readers: list[Reader], targets: list[str]) -> None:
    for reader, target in zip(readers, targets):
        wait_for(lambda r=reader, t=target: os.readlink(f"/proc/{r.proc.pid}/cwd") ==
                 os.path.join(t, "dir0"), 30, "the reader to start")
    time.sleep(0.5)


def _clean(tally: dict) -> None:
    print("reader:", {k: tally.get(k) for k in ("ok", "failed", "wrong", "worst", "stalled")})
    assert tally["ok"] > 0 and tally["failed"] == {} and tally["wrong"] == 0, tally


# a `sleep` beside the plugin (in its pid namespace or cgroup; the plugin's
# child once the shell execs it), to show the kill reached everything there
SLEEPER = "sleep 600 & exec \"$@\""


def _sleeper(parent: int) -> int:
    return next(p for p in children_of(parent)
                if open(f"/proc/{p}/comm").read().strip() == "sleep")


def _cgroup() -> str:
    if not os.path.exists(os.path.join(UNIFIED, "cgroup.procs")):
        pytest.skip(f"no cgroup v2 hierarchy at {UNIFIED}")
    path = os.path.join(UNIFIED, f"bc-plugin-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    if not os.path.exists(os.path.join(path, "cgroup.kill")):
        os.rmdir(path)
        pytest.skip("this kernel's cgroup v2 has no cgroup.kill")
    return path


@pytest.mark.parametrize("how", ["pid-1-killed", "cgroup-killed"])
def test_the_plugins_container_dying_costs_no_mount_a_read(world, keepers, tmp_path, how):
    cgroup = _cgroup() if how == "cgroup-killed" else ""
    if cgroup:  # the plugin, and a sleep beside it, in a cgroup of their own
        wrap = ("sh", "-c", f"echo $$ > {cgroup}/cgroup.procs; {SLEEPER}", "sh")
    else:  # PID 1 of a pid namespace, a sleep beside it
        wrap = (*UNSHARE, "sh", "-c", SLEEPER, "sh")
    targets = [world.target(), world.target()]
    readers: list[Reader] = []
    with ExitStack() as stack:
        stack.callback(lambda: cgroup and _remove_cgroup(cgroup))
        plugin = world.plugin(state=f"state-{how}", name=f"{how}-1", wrap=wrap)
        plugin.env = {**plugin.env, "PLUGIN_ONLY": "not for servers"}
        stack.enter_context(running(plugin.start()))
        for i, target in enumerate(targets):
            plugin.publish(f"vol-{i}", target, world.context(f"dying{i}"), world.key)
        before = {t: pids(t) for t in targets}
        host = HostClient(keepers.socket)
        for keeper, server in before.values():
            assert host.alive(keeper)
            for pid in (keeper, server):  # an environment the plugin built, not its own
                assert b"PLUGIN_ONLY" not in open(f"/proc/{pid}/environ", "rb").read()
        for target in targets:
            readers.append(Reader(target, world.source, tmp_path))
            stack.callback(readers[-1].kill)
        _reading(readers, targets)
        main = plugin.proc.pid if cgroup else pid_one(plugin.proc)
        victims = [main, _sleeper(main)]
        if cgroup:
            with open(os.path.join(cgroup, "cgroup.kill"), "w") as f:
                f.write("1")
        else:
            os.kill(main, signal.SIGKILL)  # the kernel kills its whole namespace
        for pid in victims:
            wait_dead(pid)  # (the sleep too: the kill reached everything there)
        plugin.proc.wait(10)
        time.sleep(1.0)
        for target in targets:  # every keeper and server lives on, the host's
            assert pids(target) == before[target]
            assert status_of(before[target][0])["PPid"] == str(keepers.pid)

        second = stack.enter_context(running(world.plugin(
            state=f"state-{how}", name=f"{how}-2").start()))
        for target in targets:
            assert pids(target) == before[target]  # kept, not taken over
        third = world.target()
        second.publish("vol-new", third, world.context("dying-new"), world.key)
        second.unpublish("vol-new", third)
        assert third not in mounts_under(os.path.dirname(third))
        for reader in readers:
            _clean(reader.finish())
        for i, target in enumerate(targets):
            second.unpublish(f"vol-{i}", target)
            wait_dead(before[target][0])
            assert not host.alive(before[target][0])


def _serving_keeper(target: str) -> int | None:
    try:
        st = keeper_status(target)
    except MountError:  # (between two keepers)
        return None
    return st["keeper"] if st["serving"] else None


def _ended(pid: int) -> bool:
    """Whether `pid` has exited (a zombie of a stopped parent counts)."""
    try:
        return status_of(pid)["State"].startswith("Z")
    except FileNotFoundError:
        return True


def _remove_cgroup(path: str) -> None:
    """Kill whatever is left in the test's cgroup, and remove it."""
    with suppress(OSError):
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
    deadline = time.monotonic() + 10
    while os.path.isdir(path) and time.monotonic() < deadline:
        with suppress(OSError):
            os.rmdir(path)
        time.sleep(0.1)


def _memory_cgroup(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return "/sys/fs/cgroup/memory" + path
    raise AssertionError(f"process {pid} is in no v1 memory cgroup")


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().split()[0])


def _oom_kills(cgroup: str) -> int:
    with open(os.path.join(cgroup, "memory.oom_control")) as f:
        fields = dict(line.split() for line in f)
    return int(fields.get("oom_kill", 0))


def test_one_server_past_its_memory_limit_is_killed_alone(world, tmp_path):
    limit = 256 << 20
    host = world.keeper_host(name="oom-keepers",
                             socket_path=os.path.join(world.base, "oom", "keepers.sock"),
                             args=("--server-memory", str(limit)))
    targets = [world.target(), world.target()]
    readers: list[Reader] = []
    with ExitStack() as stack:
        stack.enter_context(running(host.start()))
        if "cgroup v1 memory" not in host.log():
            pytest.skip(f"the host found no v1 memory cgroup here: {host.log()}")
        plugin = stack.enter_context(running(world.plugin(
            state="state-oom", name="oom", keepers=host.socket).start()))
        for i, target in enumerate(targets):
            plugin.publish(f"vol-{i}", target, world.context(f"oom{i}"), world.key)
        before = {t: keeper_status(t) for t in targets}
        cgroups = {t: _memory_cgroup(before[t]["server"]) for t in targets}
        for t in targets:  # a cgroup per keeper, with the host's limit, server in it
            assert os.path.basename(cgroups[t]).startswith("keeper-")
            assert _memory_cgroup(before[t]["keeper"]) == cgroups[t]
            assert _read_int(os.path.join(cgroups[t], "memory.limit_in_bytes")) == limit
        assert cgroups[targets[0]] != cgroups[targets[1]]
        for target in targets:
            readers.append(Reader(target, world.source, tmp_path))
            stack.callback(readers[-1].kill)
        _reading(readers, targets)

        # squeeze the first keeper's cgroup to what it uses: the server's next
        # allocations (reads of fresh pages) are past its limit
        victim = cgroups[targets[0]]
        with open(os.path.join(victim, "memory.force_empty"), "w") as f:
            f.write("0")
        squeezed = _read_int(os.path.join(victim, "memory.usage_in_bytes")) + (1 << 20)
        with open(os.path.join(victim, "memory.limit_in_bytes"), "w") as f:
            f.write(str(squeezed))
        wait_for(lambda: _oom_kills(victim) > 0, 60, "an OOM kill in the squeezed cgroup")
        wait_dead(before[targets[0]]["server"])
        with open(os.path.join(victim, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))  # room again: the keeper's next server starts
        time.sleep(2.0)
        after = {t: keeper_status(t) for t in targets}
        assert after[targets[0]]["keeper"] == before[targets[0]]["keeper"]
        assert after[targets[0]]["server"] != before[targets[0]]["server"]
        assert (after[targets[1]]["keeper"], after[targets[1]]["server"]) == \
            (before[targets[1]]["keeper"], before[targets[1]]["server"])  # untouched
        assert _oom_kills(cgroups[targets[1]]) == 0
        tallies = [reader.finish() for reader in readers]
        _clean(tallies[1])
        _clean(tallies[0])  # (its own reads too: FUSE_NOTIFY_RESEND, kernel 6.9+)
        for i, target in enumerate(targets):
            plugin.unpublish(f"vol-{i}", target)
        wait_for(lambda: not any(os.path.isdir(c) for c in cgroups.values()), 30,
                 "the keepers' cgroups removed")


def test_a_new_keeper_host_takes_every_keeper_over_before_it_is_ready(world, tmp_path):
    sock = os.path.join(world.base, "upgrade", "keepers.sock")
    ready = os.path.join(world.base, "upgrade-new.ready")
    old = world.keeper_host(name="upgrade-old", socket_path=sock, wrap=UNSHARE)
    new = world.keeper_host(name="upgrade-new", socket_path=sock, wrap=UNSHARE)
    targets = [world.target(), world.target()]
    readers: list[Reader] = []
    with ExitStack() as stack:
        stack.enter_context(running(old.start()))
        plugin = stack.enter_context(running(world.plugin(
            state="state-upgrade", name="upgrade", keepers=sock).start()))
        for i, target in enumerate(targets):
            plugin.publish(f"vol-{i}", target, world.context(f"up{i}"), world.key)
        old_pid = old.pid
        assert set(keepers_under(old_pid)) == set(targets)
        for target in targets:
            readers.append(Reader(target, world.source, tmp_path))
            stack.callback(readers[-1].kill)
        _reading(readers, targets)
        # the first keeper is busy (a restart running) and refuses to surrender
        busy = Busy(targets[0], keepers_under(old_pid)[targets[0]])
        stack.callback(lambda: busy.release() if busy.thread.is_alive() else None)
        assert busy.refuses()

        old_socket = f"{sock}.old-host"  # (to ask it once its successor has the path)
        os.link(sock, old_socket)
        stack.callback(lambda: os.path.exists(old_socket) and os.unlink(old_socket))
        stack.enter_context(running(new.start(ready_file=ready, wait=False)))
        wait_for(lambda: "not ours yet" in new.log(), 60, "the new host to retry the busy one")
        new_pid = new.pid
        # a publish now reaches the old host (its socket is still at the path)
        raced = world.target()
        plugin.publish("vol-raced", raced, world.context("raced"), world.key)
        assert raced in keepers_under(old_pid)
        time.sleep(1.0)
        assert not os.path.exists(ready)  # not while a keeper is not its own
        busy.release()
        wait_for(lambda: os.path.exists(ready), 90, "the new host's ready file")
        assert set(keepers_under(new_pid)) == {*targets, raced}
        assert {k["mountpoint"] for k in HostClient(sock).list()} == {*targets, raced}
        # the old host now sends a spawn to its successor, starting nothing
        late = world.target()
        answer, _ = HostClient(old_socket)._once(
            {"op": "spawn", "argv": ["mount", world.source, late], "env": {},
             "mountpoint": late, "source": world.source, "fds": []}, 30, ())
        assert answer[-1].get("replaced") is True, answer
        assert late not in keepers_under(old_pid)
        # the old pod goes: everything in its pid namespace dies with its PID 1
        os.kill(old_pid, signal.SIGKILL)
        wait_dead(old_pid)
        time.sleep(1.0)
        for reader in readers:
            _clean(reader.finish())
        assert sorted(os.listdir(raced)) == sorted(os.listdir(world.source))
        for i, target in enumerate([*targets, raced]):
            plugin.unpublish(["vol-0", "vol-1", "vol-raced"][i], target)
        wait_for(lambda: keepers_under(new_pid) == {}, 30, "the keepers to end")


def test_a_keeper_killed_alone_is_taken_back_by_the_host(world, keepers, plugin, tmp_path):
    """A keeper of the host killed alone: its server starts a keeper of its own
    (fsclient's successor, the server's uid); the host takes the mount back to
    a keeper of its own at once, with no failed read, so its `list` (what a
    host upgrade moves) shows the mount again."""
    target = world.target()
    host = HostClient(keepers.socket)
    with ExitStack() as stack:
        stack.callback(lambda: print(keepers.log()))  # shown on failure
        plugin.publish("vol-lost", target, world.context("lost"), world.key)
        lost = host.keeper_of(target)
        assert lost == keeper_status(target)["keeper"]
        reader = Reader(target, world.source, tmp_path)
        stack.callback(reader.kill)
        _reading([reader], [target])
        os.kill(lost, signal.SIGKILL)
        wait_for(lambda: host.keeper_of(target) not in (None, lost), 90,
                 "the host to take the mount back")
        taken = host.keeper_of(target)
        assert keeper_status(target)["keeper"] == taken
        assert f"took {target} back from the keeper its server started" in keepers.log()
        _clean(reader.finish())
        plugin.unpublish("vol-lost", target)
        wait_dead(taken)


def test_a_plugin_keeps_asking_a_keeper_that_refuses_to_surrender(world, tmp_path):
    """A mount kept by a keeper not the host's is surrendered to a keeper of the
    host at the plugin's start; while it is busy, the plugin asks again and is
    not ready. Here that keeper is a server's successor that no host took back
    (its host was stopped when the keeper was killed; the plugin asks a fresh
    host beside it). The plugins run in pid namespaces of their own, as in
    their container: that keeper runs as the server's uid, trusted by a pid
    only the host sees, so the host asks for the connection."""
    ready = os.path.join(world.base, "refusing.ready")
    target = world.target()
    old_socket = os.path.join(world.base, "refusing-old", "keepers.sock")
    new_socket = os.path.join(world.base, "refusing-new", "keepers.sock")
    with ExitStack() as stack:
        old_host = stack.enter_context(running(world.keeper_host(
            name="refusing-old", socket_path=old_socket).start()))
        first = stack.enter_context(running(world.plugin(
            state="state-refusing", name="refusing-1", keepers=old_socket,
            wrap=UNSHARE).start()))
        first.publish("vol-r", target, world.context("refusing"), world.key)
        host_keeper = keeper_status(target)["keeper"]
        first.stop(signal.SIGKILL)
        os.kill(old_host.pid, signal.SIGSTOP)  # (it would take the mount back)
        stack.callback(lambda: old_host.stop(signal.SIGKILL))
        os.kill(host_keeper, signal.SIGKILL)  # its server starts a keeper of its own
        wait_for(lambda: _serving_keeper(target) not in (None, host_keeper), 30,
                 "the server's new keeper")
        stray = keeper_status(target)["keeper"]
        # its parent, the server before, hands over and exits: the orphan is
        # the old host's (a subreaper, as its container's PID 1 would be)
        wait_for(lambda: status_of(stray)["PPid"] == str(old_host.pid), 60,
                 "the stray keeper to be the old host's orphan")
        reader = Reader(target, world.source, tmp_path)
        stack.callback(reader.kill)
        _reading([reader], [target])
        busy = Busy(target, stray)
        stack.callback(lambda: busy.release() if busy.thread.is_alive() else None)

        new_host = stack.enter_context(running(world.keeper_host(
            name="refusing-new", socket_path=new_socket).start()))
        host = HostClient(new_socket)
        assert host.keeper_of(target) is None
        second = stack.enter_context(running(world.plugin(
            state="state-refusing", name="refusing-2", keepers=new_socket,
            args=("--ready-file", ready), wrap=UNSHARE)))
        started = threading.Thread(target=second.start, daemon=True)
        started.start()
        wait_for(lambda: "does not surrender" in second.log(), 60, "the plugin to ask again")
        time.sleep(1.0)
        assert not os.path.exists(ready)
        busy.release()
        started.join(90)
        wait_for(lambda: os.path.exists(ready), 30, "the plugin's ready file")
        taken = keeper_status(target)
        assert host.keeper_of(target) == taken["keeper"] != stray
        assert f"took {target} over" in second.log()
        wait_for(lambda: _ended(stray), 60, "the stray keeper to end")
        _clean(reader.finish())
        second.unpublish("vol-r", target)
        wait_dead(taken["keeper"])
        assert new_host.answers()


ASK_AS_OTHER = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(30)
s.connect(sys.argv[1])
s.send(sys.argv[2].encode())
data, fds, _flags, _addr = socket.recv_fds(s, 65536, 16)
print(json.dumps({"answer": json.loads(data), "fds": len(fds)}))
"""


def test_the_keeper_host_answers_root_only(world, keepers, plugin, tmp_path):
    """Its socket is 0600 in a 0700 dir; even through a link another uid may
    open, it answers no one but root (SO_PEERCRED): not a `list`, and not a
    `surrender` of a live mount's connection, asked as the servers' own uid
    (65534) or any other; that keeper serves on."""
    folder = os.path.dirname(keepers.socket)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(keepers.socket).st_mode) == 0o600
    target = world.target()
    plugin.publish("vol-asked", target, world.context("asked"), world.key)
    keeper = keeper_status(target)["keeper"]
    opened = os.path.join(world.base, "keepers-opened.sock")
    os.link(keepers.socket, opened)
    asked = []
    try:
        os.chmod(opened, 0o666)  # (the same inode: a misconfigured socket, say)
        for uid in (NOBODY.pw_uid, INTRUDER):
            for op in ({"op": "list"}, {"op": "surrender", "mountpoint": target}):
                asked.append(subprocess.run(
                    [world.python, "-c", ASK_AS_OTHER, opened, json.dumps(op)], user=uid,
                    group=NOBODY.pw_gid, extra_groups=[], env=world.env,
                    capture_output=True, text=True, timeout=60))
    finally:
        os.chmod(opened, 0o600)
        os.unlink(opened)
    for run in asked:
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout) == {
            "answer": {"error": "only root may ask the keeper host"}, "fds": 0}
    for uid in (NOBODY.pw_uid, INTRUDER):
        assert f"uid {uid}, not root; refused" in keepers.log()
    assert keeper_status(target)["keeper"] == keeper
    plugin.unpublish("vol-asked", target)
    host = HostClient(keepers.socket)
    assert host.list() is not None  # root is answered
    # and it stops its own keepers only
    with pytest.raises(HostError) as info:
        host.stop(os.getpid())
    assert "is no keeper of this host" in str(info.value)
    assert not host.alive(os.getpid())


def test_without_its_keeper_host_a_publish_says_what_to_run(world):
    host = world.keeper_host(name="gone-keepers",
                             socket_path=os.path.join(world.base, "gone", "keepers.sock"))
    target = world.target()
    with ExitStack() as stack:
        stack.enter_context(running(host.start()))
        plugin = stack.enter_context(running(world.plugin(
            state="state-gone", name="gone", keepers=host.socket).start()))
        host.stop()
        with pytest.raises(grpc.RpcError) as info:
            plugin.publish("vol-g", target, world.context("gone"), world.key)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert host.socket in info.value.details()
        assert "blockcache-csi-keepers" in info.value.details()
        assert target not in mounts_under(os.path.dirname(target))
        assert not os.listdir(os.path.join(world.base, "state-gone", "mounts"))  # no record
