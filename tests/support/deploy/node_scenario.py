"""One simulated GPU node: the DaemonSet's pod, then the sidecar recipe's training pod.

    unshare --mount --propagation private python -m tests.support.deploy.node_scenario ROOT BIN

Runs inside a mount namespace of its own (the node's), so the pods' mounts
(shared pod volumes, each container's namespace, FUSE) never reach the host
and vanish with it. Uses `podsim` with per-container mount namespaces and
prints one JSON object with what it observed (exit codes, outputs, logs);
test_pods_run judges it. The one change to the manifests: the volume's S3
source becomes a local directory (no S3 here). BIN holds the containers'
commands (package_install.bin_dir).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.deploy.paths import DAEMONSET, EXAMPLE_SIDECAR
from tests.support.deploy.podsim import Pod
from tests.support.deploy.render import named, one, pod_spec, render
from tests.support.deploy.unit_runner import is_mounted

WAIT = 30.0
FILES = {f"train/{i:03d}.jpg": 120_000 + i for i in range(4)}   # name -> size


def wait_until(check, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def volume_key() -> bytes:
    from blockcache_client.volumekey import generate_key_file

    path = Path(f"/tmp/blockcache-key-{os.getpid()}")
    try:
        generate_key_file(str(path))
        return path.read_bytes()
    finally:
        path.unlink(missing_ok=True)


def local(text: str, source: Path) -> str:
    """A ConfigMap's TOML for this host: the S3 source becomes `source`, and
    metrics endpoints move to free loopback ports (pods have IPs of their
    own; here every process shares the host's network)."""
    text = text.replace('"s3://bucket/prefix"', f'"{source}"')
    # No cluster DNS on one simulated node, so no [cluster] table (to the
    # end of the file or the next table); the tier's own tests run real pools.
    text = re.sub(r"^\[cluster\]\n(?:(?!\[).*\n?)*", "", text, flags=re.M)
    return re.sub(r'^metrics_addr = "[^"]*"', 'metrics_addr = "127.0.0.1:0"', text, flags=re.M)


def metrics_on(workload: dict, configmaps: dict[str, dict[str, str]]) -> bool:
    """Whether a workload's ConfigMaps turn a metrics endpoint on."""
    names = [v["configMap"]["name"] for v in pod_spec(workload)["volumes"] if "configMap" in v]
    return any(re.search(r"^metrics_addr\s*=", text, re.M)
               for n in names for text in configmaps[n].values())


def scrape(log: Path) -> str:
    """The /metrics page of the process that logged where it serves it."""
    url = None
    if wait_until(lambda: re.search(r"serving metrics on (http://[^\s\"]+/metrics)",
                                    log.read_text(errors="replace"))):
        url = re.search(r"serving metrics on (http://[^\s\"]+/metrics)",
                        log.read_text(errors="replace")).group(1)
    if url is None:
        return ""
    with urllib.request.urlopen(url, timeout=WAIT) as r:
        return r.read().decode()


def run(root: Path, bin_dir: Path) -> dict[str, Any]:
    """The scenario; every observation goes into the returned dict."""
    from blockcache_client.daemonclient.client import Client

    obs: dict[str, Any] = {"expected_bytes": sum(FILES.values())}
    daemon_objs, sidecar_objs = render(DAEMONSET), render(EXAMPLE_SIDECAR)
    ds, job = named(daemon_objs, "DaemonSet", "blockcached"), one(sidecar_objs, "Job")
    source = root / "bucket"
    for name, size in FILES.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(os.urandom(size))
    configmaps = {o["metadata"]["name"]: {k: local(v, source) for k, v in o["data"].items()}
                  for o in daemon_objs + sidecar_objs if o["kind"] == "ConfigMap"}
    key_volume = next(v for v in pod_spec(job)["volumes"] if v["name"] == "volume-key")
    secrets = {key_volume["secret"]["secretName"]:
               {key_volume["secret"]["items"][0]["key"]: volume_key()}}
    node = root / "node"
    daemon = Pod(pod_spec(ds), configmaps, {}, node, root / "daemon-pod", bin_dir,
                 namespaces=True)
    trainer = Pod(pod_spec(job), configmaps, secrets, node, root / "training-pod", bin_dir,
                  namespaces=True)
    procs: dict[str, subprocess.Popen] = {}
    mountpoint = None
    try:
        init = daemon.run("own-dirs")
        obs["init"] = [init.returncode, init.stderr]
        procs["daemon"] = daemon.start("blockcached", root / "blockcached.log")
        obs["ready"] = wait_until(
            lambda: daemon.probe("blockcached", "readinessProbe").returncode == 0)
        obs["liveness"] = daemon.probe("blockcached", "livenessProbe").returncode
        if metrics_on(ds, configmaps):
            obs["daemon_metrics"] = scrape(root / "blockcached.log")
        procs["sidecar"] = trainer.start("fsclient", root / "fsclient.log")
        obs["started"] = wait_until(
            lambda: trainer.probe("fsclient", "startupProbe").returncode == 0)
        if metrics_on(job, configmaps):
            obs["fsclient_metrics"] = scrape(root / "fsclient.log")
        sidecar = trainer.container("fsclient")
        mountpoint = Path(trainer.rewrite("/mnt/datasets/imagenet", sidecar))
        # In the sidecar's namespace the cache and socket dirs are read-only.
        for mount_path in ("/var/cache/blockcache", "/run/blockcache"):
            probe = trainer.run("fsclient", ["sh", "-c", f"touch {mount_path}/planted"])
            obs.setdefault("writable_in_sidecar", []).append(probe.returncode == 0)
        t = trainer.run("trainer")
        obs["trainer"] = [t.returncode, t.stdout, t.stderr]
        with Client(daemon.env(daemon.container("blockcached"))["BLOCKCACHE_SOCKET"]) as c:
            wait_until(lambda: c.stats()["entries"] >= len(FILES))
            obs["entries"] = c.stats()["entries"]
        obs["after_sidecar_restart"] = sidecar_restart(trainer, procs, root)
        procs["sidecar"].send_signal(signal.SIGTERM)
        obs["sidecar_exit"] = procs["sidecar"].wait(
            timeout=pod_spec(job)["terminationGracePeriodSeconds"])
        obs["mounted_after_stop"] = is_mounted(mountpoint)
        procs["daemon"].send_signal(signal.SIGTERM)
        obs["daemon_exit"] = procs["daemon"].wait(
            timeout=pod_spec(ds)["terminationGracePeriodSeconds"])
    except Exception as exc:  # reported, with the logs, to the test
        obs["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        if mountpoint and is_mounted(mountpoint):
            subprocess.run(["fusermount3", "-uz", str(mountpoint)], timeout=WAIT)
        obs["logs"] = {p.name: p.read_text(errors="replace") for p in sorted(root.glob("*.log"))}
    return obs


def sidecar_restart(pod: Pod, procs: dict[str, subprocess.Popen], root: Path) -> list:
    """A trainer keeps reading across a crash and restart of its sidecar.

    The trainer's mount namespace lives on; the killed sidecar leaves a dead
    mount, the restarted one (restartPolicy Always) lazily unmounts it and
    mounts again, and both events must reach the trainer (HostToContainer).
    Returns [exit code, byte counts printed, stderr] of that trainer.
    """
    go = root / "go"
    read = "find /mnt/datasets/imagenet -type f -exec cat {} + | wc -c"
    c = pod.container("trainer")
    cmd = ["bash", "-o", "pipefail", "-c",
           f"{read} && while [ ! -e {go} ]; do sleep 0.1; done && {read}"]
    p = subprocess.Popen(pod.argv(c, cmd), env=pod.env(c), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        first = p.stdout.readline()           # the first pass, through the first mount
        pod.kill(procs["sidecar"])  # the whole container: fsclient's keeper and server
        procs["sidecar"] = pod.start("fsclient", root / "fsclient-restarted.log")
        if not wait_until(lambda: pod.probe("fsclient", "startupProbe").returncode == 0):
            return [None, first, "the restarted sidecar's startup probe never passed"]
        go.touch()
        out, err = p.communicate(timeout=WAIT)
        return [p.returncode, first + out, err]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def main(argv: list[str]) -> int:
    print(json.dumps(run(Path(argv[1]), Path(argv[2]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
