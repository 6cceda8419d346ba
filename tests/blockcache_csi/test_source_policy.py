"""The operator's source policy (`--allow-source`): a pod's `source` is put in
one canonical form and mounted only if a rule allows it for the pod's
namespace. Every forbidden source is refused by name (PERMISSION_DENIED,
the rule and the setting), before anything is recorded or mounted; an
allowed one, written in any of its aliases, is served end to end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import grpc
import pytest

from tests.support.csi_plugin import kubelet_keys
from tests.support.fsclient_mounts import REPO
from tests.support.keepers import keeper_status
from tests.support.proc_files import mounts_under
from tests.support.trees import snapshot

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(120)]
DENIED = grpc.StatusCode.PERMISSION_DENIED


def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    return info.value.details()


@pytest.fixture(scope="module")
def loopback():
    """A port on 127.0.0.1 where a service listens (the SSRF's target)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _forbidden(world, loopback: int) -> dict[str, tuple[str, str]]:
    """id -> (source, what its refusal must name)."""
    refs = json.dumps({"version": 1, "refs": {
        "f": ["file:///proc/self/environ", 0, 1]}})
    return {
        "local-root": ("/", "--allow-source default=/ "),
        "reference": (f"reference::data:application/json,{refs}", "reference"),
        "data": ("data:,secret", "protocol 'data'"),
        "memory": ("memory://dataset", "protocol 'memory'"),
        "loopback-http": (f"http://127.0.0.1:{loopback}/", "--allow-source default="
                                                          f"http://127.0.0.1:{loopback}"),
        "unlisted-bucket": ("s3://someone-elses-bucket/data",
                            "--allow-source default=s3://someone-elses-bucket/data"),
        "chained-cache": ("simplecache::s3://someone-elses-bucket/data", "simplecache::s3"),
        # aliases and path tricks read as what they are
        "s3a-alias": ("s3a://someone-elses-bucket/data", "s3://someone-elses-bucket/data"),
        "dotdot-out": (os.path.join(world.source, "..", ".."), "--allow-source"),
        "file-alias-root": ("file:///", "--allow-source default=/ "),
        "local-alias": ("local:///etc", "read as /etc"),
        "symlink-out": (os.path.join(world.source, "escape"), "read as /"),
    }


@pytest.mark.parametrize("case", [
    "local-root", "reference", "data", "memory", "loopback-http", "unlisted-bucket",
    "chained-cache", "s3a-alias", "dotdot-out", "file-alias-root", "local-alias",
    "symlink-out"])
def test_a_forbidden_source_is_refused_by_name(world, plugin, loopback, case):
    escape = os.path.join(world.source, "escape")
    if not os.path.lexists(escape):
        os.symlink("/", escape)  # inside the allowed dir, pointing out of it
    try:
        source, names = _forbidden(world, loopback)[case]
        target = world.target()
        message = _refused(lambda: plugin.publish(
            "vol-x", target, dict(world.context("x"), source=source), world.key), DENIED)
        assert names in message, message
        assert 'volume_context["source"]' in message
        assert "--allow-source" in message or "no setting allows" in message, message
        assert not mounts_under(os.path.dirname(target))
        assert not os.listdir(os.path.join(world.base, "state", "mounts"))
    finally:
        os.unlink(escape)


def test_an_allowed_source_works_under_any_alias(world, plugin):
    for n, source in enumerate((f"file://{world.source}/dir0", f"local://{world.source}/dir0",
                                os.path.join(world.source, "dir1", "..", "dir0"))):
        target = world.target()
        plugin.publish(f"vol-{n}", target, dict(world.context("alias"), source=source),
                       world.key)
        try:
            assert snapshot(target) == snapshot(os.path.join(world.source, "dir0"))
            # the keeper mounts the canonical path that was checked, not the alias
            with open(f"/proc/{keeper_status(target)['keeper']}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            assert os.fsencode(os.path.join(world.source, "dir0")) in argv
            assert not any(b"://" in a or b".." in a for a in argv), argv
        finally:
            plugin.unpublish(f"vol-{n}", target)


def test_rules_per_namespace(world, keepers):
    copy = os.path.join(world.base, "team-a-data")  # team-a's alone
    subprocess.run(["cp", "-a", os.path.join(world.source, "dir1"), copy], check=True,
                   timeout=60)
    p = world.plugin(state="state-ns-rules", name="ns-rules",
                     args=("--allow-source", f"team-a={copy}")).start()
    try:
        target = world.target()
        ctx = dict(world.context("team-a", namespace="team-b"), source=copy)
        message = _refused(lambda: p.publish("v", target, ctx, world.key), DENIED)
        assert "namespace 'team-b'" in message and f"--allow-source team-b={copy}" in message
        assert f"team-a={copy}" not in message  # another namespace's rules are not shown
        p.publish("v", target, dict(ctx, **kubelet_keys("team-a")), world.key)
        assert snapshot(target) == snapshot(copy)
        p.unpublish("v", target)
    finally:
        p.stop()
        print(p.log())


def test_a_publish_without_the_kubelets_namespace_is_refused(world, plugin):
    ctx = world.context()
    del ctx["csi.storage.k8s.io/pod.namespace"]
    message = _refused(lambda: plugin.publish("v", world.target(), ctx, world.key),
                       grpc.StatusCode.INVALID_ARGUMENT)
    assert "csi.storage.k8s.io/pod.namespace" in message and "podInfoOnMount" in message


def _start_error(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockcache_csi", "--endpoint",
                           "unix:///nonexistent/csi.sock", "--node-id", "n", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, says", [
    (("--allow-source", "ftp://host/x"), "protocol 'ftp'"),
    (("--allow-source", "a::b"), "chains filesystems"),
    (("--allow-source", "Team_A=s3://b/x"), "not a namespace name"),
    (("--allow-source", "relative/dir"), "neither an absolute path nor a URL"),
    (("--s3-endpoint", "ftp://x"), "--s3-endpoint"),
    (("--allow-node-credentials", "Bad_NS"), "--allow-node-credentials"),
])
def test_a_bad_policy_setting_is_refused_at_start(args, says):
    out = _start_error(*args)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr, out.stderr
