"""The DaemonSet's pod and the sidecar recipe's training pod, run together on one
simulated node (node_scenario, podsim): the manifests' commands,
securityContexts, env, probes, ConfigMaps, Secret, read-only mounts and
mount propagation work with the real daemon and fsclient.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.support.deploy import unit_runner
from tests.support.deploy.package_install import bin_dir
from tests.support.deploy.paths import REPO

pytest.importorskip("blockcached", reason="the daemon package blockcached is not installed")
pytest.importorskip("fsclient.mount", reason="fsclient is not installed")
pytestmark = [*unit_runner.fuse_marks(),
              pytest.mark.skipif(shutil.which("unshare") is None,
                                 reason="needs unshare (util-linux) for the node's "
                                        "mount namespace")]


@pytest.fixture(scope="module")
def node():
    """What node_scenario observed, run in a mount namespace of its own."""
    with unit_runner.scratch_root() as root:
        # Its own process group: on a hang, every pod process goes with it.
        p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", sys.executable,
                              "-m", "tests.support.deploy.node_scenario", str(root),
                              str(bin_dir())],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=110)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert p.returncode == 0 and out.strip(), err
        obs = json.loads(out.strip().splitlines()[-1])
    logs = "\n".join(f"--- {name} ---\n{text}" for name, text in obs["logs"].items())
    assert "error" not in obs, f"{obs['error']}\n{logs}"
    obs["all_logs"] = logs
    return obs


def test_daemonset_pod_starts_as_its_manifest_says(node):
    # The init container, with CAP_CHOWN only, gives uid 10001 its host dirs;
    # the daemon, as 10001 without capabilities, then serves and answers the
    # probes through the env the manifest sets.
    assert node["init"] == [0, ""]
    assert node["ready"], node["all_logs"]
    assert node["liveness"] == 0


def test_training_pod_reads_the_volume_through_the_sidecar(node):
    # The startup probe passes once the sidecar's FUSE mount is up; the
    # trainer (uid 1000, another mount namespace, HostToContainer) sees the
    # mount the sidecar made (Bidirectional) and reads every byte.
    assert node["started"], node["all_logs"]
    code, out, err = node["trainer"]
    assert code == 0, err
    assert int(out.split()[-1]) == node["expected_bytes"]
    # Misses went to the daemon through the read-only socket dir.
    assert node["entries"] >= 4


def test_trainer_survives_a_sidecar_restart(node):
    # Killed sidecar, dead mount, restarted sidecar, new mount: a running
    # trainer sees the unmount and the new mount (HostToContainer) and reads
    # the whole volume again.
    code, out, err = node["after_sidecar_restart"]
    assert code == 0, f"{err}\n{node['all_logs']}"
    assert [int(n) for n in out.split()] == [node["expected_bytes"]] * 2


def test_sidecar_mounts_cache_and_socket_dirs_read_only(node):
    assert node["writable_in_sidecar"] == [False, False]


def test_metrics_endpoints_serve_where_configured(node):
    # The manifests' metrics_addr, moved to loopback ports (see node_scenario).
    if "daemon_metrics" in node:
        assert "blockcache_up 1.0" in node["daemon_metrics"], node["all_logs"]
    if "fsclient_metrics" in node:
        assert "blockcache_client_hits_total" in node["fsclient_metrics"], node["all_logs"]
    if "daemon_metrics" not in node and "fsclient_metrics" not in node:
        pytest.skip("no metrics_addr in the manifests' configs")


def test_pods_stop_cleanly(node):
    assert node["sidecar_exit"] == 0 and not node["mounted_after_stop"]
    assert node["daemon_exit"] == 0
