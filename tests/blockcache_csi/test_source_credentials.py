"""Credentials per volume, never the plugin's: an s3:// volume signs with the
keys of its own Secret; its keeper and server run in an environment the
plugin built (none of its variables, none of its AWS keys); a volume with no
keys sends unsigned requests, which S3 refuses, and never falls back on the
plugin's keys. The keys are kept 0600 root beside the volume key, in no
record, log or command line, and a restarted plugin mounts with them again.

The S3 server is moto on loopback with authentication on: the plugin's own
keys ("operator") are valid there too, so any fallback to them would read."""

from __future__ import annotations

import os
import signal
import stat

import grpc
import pytest

from devtools.s3server import S3Server
from tests.support.keepers import keeper_status
from tests.support.proc_files import environ_of, mounts_under, wait_dead
from tests.support.s3auth import access_key, enforce
from tests.support.trees import snapshot

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(180)]
PREFIX = "vol"


@pytest.fixture(scope="module")
def s3(world):
    server = S3Server(module="tests.support.moto_private").start()
    try:
        fs = server.filesystem()
        for dirpath, _, files in os.walk(world.source):
            for name in files:
                full = os.path.join(dirpath, name)
                if not os.path.islink(full):
                    rel = os.path.relpath(full, world.source)
                    with open(full, "rb") as f:
                        fs.pipe(f"{server.bucket}/{PREFIX}/{rel}", f.read())
        operator, tenant = access_key(server, "operator"), access_key(server, "tenant")
        enforce(server)
        yield server, operator, tenant
    finally:
        server.stop()


def _environ_text(pid: int) -> str:
    return "\n".join(f"{k}={v}" for k, v in environ_of(pid).items())


def test_a_volume_signs_with_its_own_secret_never_the_plugins(world, keepers, s3):
    server, operator, tenant = s3
    plugin_env = {"AWS_ACCESS_KEY_ID": operator[0], "AWS_SECRET_ACCESS_KEY": operator[1],
                  "AWS_DEFAULT_REGION": "us-east-1", "BLOCKCACHE_CANARY": "1"}
    args = ("--allow-source", f"s3://{server.bucket}/{PREFIX}", "--s3-endpoint",
            server.endpoint_url, "--s3-region", "us-east-1")
    state = os.path.join(world.base, "state-s3")
    plugin = first = world.plugin(state="state-s3", name="s3", args=args,
                                  env=plugin_env).start()
    successor = None
    ctx = dict(world.context("s3vol", namespace="tenant"),
               source=f"s3a://{server.bucket}/{PREFIX}/")
    secret = {"awsAccessKeyId": tenant[0], "awsSecretAccessKey": tenant[1]}
    with_keys, without = world.target(), world.target()
    try:
        plugin.publish("vol-s3", with_keys, ctx, world.key, secrets=secret)
        assert snapshot(with_keys) == snapshot(world.source)
        st = keeper_status(with_keys)
        for pid in (st["keeper"], st["server"]):
            env = environ_of(pid)
            assert "BLOCKCACHE_CANARY" not in env and operator[1] not in _environ_text(pid)
            assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == tenant
            assert env["AWS_EC2_METADATA_DISABLED"] == "true"
            assert env["AWS_SHARED_CREDENTIALS_FILE"] == env["AWS_CONFIG_FILE"] == os.devnull
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert tenant[1].encode() not in f.read()

        # kept beside the key, root's alone; in no record or log
        keys = os.path.join(state, "keys")
        creds = [os.path.join(keys, n) for n in os.listdir(keys) if n.endswith(".creds")]
        assert len(creds) == 1
        cst = os.stat(creds[0])
        assert (cst.st_uid, stat.S_IMODE(cst.st_mode)) == (0, 0o600)
        for name in os.listdir(os.path.join(state, "mounts")):
            with open(os.path.join(state, "mounts", name)) as f:
                assert tenant[1] not in f.read()

        # no keys in its Secret: unsigned, so S3 refuses it (no fallback to the plugin's)
        with pytest.raises(grpc.RpcError) as info:
            plugin.publish("vol-anon", without, ctx, world.key)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "[Errno 13]" in info.value.details(), info.value.details()  # 403
        assert without not in mounts_under(world.base)

        # an upgrade: a new plugin's keeper takes the live mount over, with
        # the volume's keys from the state dir
        plugin.stop()
        plugin = world.plugin(state="state-s3", name="s3-1", args=args, env=plugin_env).start()
        st = keeper_status(with_keys)
        env = environ_of(st["keeper"])
        assert env["AWS_SECRET_ACCESS_KEY"] == tenant[1] and "BLOCKCACHE_CANARY" not in env
        assert snapshot(with_keys) == snapshot(world.source)

        # the plugin and the whole mount die; the next plugin mounts it again
        plugin.stop()
        for pid in (st["server"], st["keeper"]):
            os.kill(pid, signal.SIGKILL)
        for pid in (st["server"], st["keeper"]):
            wait_dead(pid)
        successor = world.plugin(state="state-s3", name="s3-2", args=args,
                                 env=plugin_env).start()
        assert snapshot(with_keys) == snapshot(world.source)
        again = keeper_status(with_keys)
        assert again["keeper"] != st["keeper"]
        env = environ_of(again["server"])
        assert env["AWS_SECRET_ACCESS_KEY"] == tenant[1] and "BLOCKCACHE_CANARY" not in env
        for p in (first, plugin, successor):  # with its keepers' and servers' logs, whole
            with open(p.log_path, errors="replace") as f:
                logs = f.read()
            assert tenant[1] not in logs and operator[1] not in logs
        successor.unpublish("vol-s3", with_keys)
        assert not os.listdir(keys)
    finally:
        for p in (successor, plugin, first):
            if p is not None:
                p.stop()
        print(first.log(), plugin.log(), successor.log() if successor else "")  # on failure
