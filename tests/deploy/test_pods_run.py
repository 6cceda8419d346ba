"""The DaemonSet's pod and the example training pod, run together on one
"node" by `podsim`: the manifests' commands, securityContexts, env, probes,
ConfigMaps and Secret work with the real daemon and fsclient.

The one change to the manifests: the volume's S3 source becomes a local
directory (no S3 here). Mount propagation and read-only mounts are not
simulated (see podsim); test_manifests checks them in the manifests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.deploy import unit_runner
from tests.deploy.paths import DAEMONSET, EXAMPLE
from tests.deploy.podsim import Pod
from tests.deploy.render import one, pod_spec, render
from tests.deploy.unit_runner import is_mounted

pytest.importorskip("blockcached", reason="the daemon package blockcached is not installed")
pytest.importorskip("fsclient.mount", reason="fsclient is not installed")
pytestmark = unit_runner.fuse_marks()

WAIT = 30.0


def wait_until(check, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {WAIT}s")
        time.sleep(0.2)


def volume_key() -> bytes:
    from blockcache_client.keyfile import generate_key_file

    with unit_runner.scratch_root() as d:
        generate_key_file(str(d / "k"))
        return (d / "k").read_bytes()



def test_daemonset_pod_and_training_pod_run_together():
    daemon_objs, example_objs = render(DAEMONSET), render(EXAMPLE)
    ds, job = one(daemon_objs, "DaemonSet"), one(example_objs, "Job")
    configmaps = {o["metadata"]["name"]: dict(o["data"])
                  for o in daemon_objs + example_objs if o["kind"] == "ConfigMap"}
    key_volume = next(v for v in pod_spec(job)["volumes"] if v["name"] == "volume-key")
    key_item = key_volume["secret"]["items"][0]["key"]
    procs: list[subprocess.Popen] = []
    mountpoint = None
    with unit_runner.scratch_root() as root:
        source = root / "bucket"
        files = {f"train/{i:03d}.jpg": os.urandom(120_000 + i) for i in range(4)}
        for name, data in files.items():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes(data)
        for cm in configmaps.values():
            for k, text in cm.items():
                cm[k] = text.replace('"s3://bucket/prefix"', f'"{source}"')
        node = root / "node"
        daemon = Pod(pod_spec(ds), configmaps, {}, node, root / "daemon-pod")
        trainer = Pod(pod_spec(job), configmaps,
                      {key_volume["secret"]["secretName"]: {key_item: volume_key()}},
                      node, root / "training-pod")
        try:
            # The init container alone gives the daemon's uid its host dirs.
            init = daemon.run("own-dirs")
            assert init.returncode == 0, init.stderr
            procs.append(daemon.start("blockcached", root / "blockcached.log"))
            wait_until(lambda: daemon.probe("blockcached", "readinessProbe").returncode == 0,
                       "the daemon never became ready")
            assert daemon.probe("blockcached", "livenessProbe").returncode == 0
            # The training pod: the sidecar mounts, its startup probe passes,
            # then the trainer (uid 1000) reads the whole volume through it.
            procs.append(trainer.start("fsclient", root / "fsclient.log"))
            wait_until(lambda: trainer.probe("fsclient", "startupProbe").returncode == 0,
                       "the sidecar's startup probe never passed")
            mountpoint = Path(trainer.rewrite("/mnt/datasets/imagenet",
                                              trainer.container("fsclient")))
            run = trainer.run("trainer")
            assert run.returncode == 0, run.stderr
            assert int(run.stdout.split()[-1]) == sum(map(len, files.values()))
            check_fills_reached_daemon(daemon, len(files))
            # Job done: the kubelet stops the sidecar, then (on rollout) the daemon.
            procs[1].send_signal(signal.SIGTERM)
            procs[1].wait(timeout=pod_spec(job)["terminationGracePeriodSeconds"])
            assert not is_mounted(mountpoint), "the sidecar left its mount behind"
            procs[0].send_signal(signal.SIGTERM)
            assert procs[0].wait(timeout=pod_spec(ds)["terminationGracePeriodSeconds"]) == 0
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            logs = "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')}"
                             for p in sorted(root.glob("*.log")))
            raise AssertionError(f"{exc}\n{logs}") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if mountpoint and is_mounted(mountpoint):
                subprocess.run(["fusermount3", "-uz", str(mountpoint)], timeout=WAIT)


def check_fills_reached_daemon(daemon: Pod, count: int) -> None:
    """The sidecar handed the misses to the daemon through the socket dir."""
    from blockcache_client.client import Client

    c = daemon.container("blockcached")
    env = daemon.env(c)
    with Client(env["BLOCKCACHE_SOCKET"]) as client:
        wait_until(lambda: client.stats()["entries"] >= count,
                   "the sidecar's fills never reached the daemon")
