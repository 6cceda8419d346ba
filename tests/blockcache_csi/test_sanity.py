"""kubernetes-csi's own conformance suite, csi-sanity, against the plugin as
a process (with a real blockcached): every Identity and Node spec passes but
the two that create their volume through a controller's CreateVolume, which
a node-only plugin has not (named in `NEEDS_CREATE_VOLUME`; docs/csi.md).

The binary is a peer's tool, beside the repo: `../shared/tools/csi-sanity`
from the repo root (CI clones the repo beside a copy of shared/). It is
required: a missing binary fails this test, naming where it was looked for.
"""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET

import pytest

from tests.support.fsclient_mounts import REPO

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(120)]

SANITY = os.path.join(os.path.dirname(REPO), "shared", "tools", "csi-sanity")
# the node-only plugin has no Controller service, so these are not run at all
NOT_NODE = "Controller|Snapshot"
# Node specs that call CreateVolume first: with no controller they cannot run
NEEDS_CREATE_VOLUME = (
    "Node Service NodeUnpublishVolume should remove target path",
    "Node Service NodeGetVolumeStats should fail when volume does not exist on the "
    "specified path",
)
# Node specs the suite skips itself, for capabilities a node-only plugin
# without staging does not advertise
SUITE_SKIPS = {
    "Node Service should work": "needs CreateVolume (no Controller service)",
    "Node Service should be idempotent": "needs CreateVolume (no Controller service)",
    "Node Service NodePublishVolume with single node multi writer capability should fail "
    "when volume with single node single writer access mode is already mounted at a "
    "different target path": "no SINGLE_NODE_MULTI_WRITER",
    **{f"Node Service {call} {spec}": "no STAGE_UNSTAGE_VOLUME" for call, spec in (
        ("NodeStageVolume", "should fail when no volume id is provided"),
        ("NodeStageVolume", "should fail when no staging target path is provided"),
        ("NodeStageVolume", "should fail when no volume capability is provided"),
        ("NodeUnstageVolume", "should fail when no volume id is provided"),
        ("NodeUnstageVolume", "should fail when no staging target path is provided"))},
    **{f"Node Service NodeExpandVolume {spec}": "no EXPAND_VOLUME" for spec in (
        "should fail when no volume id is provided", "should fail when no volume path is provided",
        "should fail when volume is not found",
        "should work if node-expand is called after node-publish")},
}
RUN_TIMEOUT = 90.0


def _skip_pattern() -> str:
    names = [n.split(" ", 2)[2] for n in NEEDS_CREATE_VOLUME]  # without "Node Service"
    return "|".join([NOT_NODE, *(n.replace(" ", r"\s") for n in names)])


def _kubelet_dir(base: str, kind: str) -> str:
    """A kubelet-shaped dir (pkg/volume/csi's), well over 150 bytes."""
    path = os.path.join(base, "kubelet", "pods", "0f6b8c2e-5d1a-4c3e-9b7f-2a4d6e8f0a1c",
                        "volumes", "kubernetes.io~csi",
                        "pvc-7e3a9f12-4b6c-4d8e-a1f2-3c4d5e6f7a8b-sanity-conformance", kind)
    assert len(path) >= 150, path
    os.makedirs(os.path.dirname(path), exist_ok=True)  # csi-sanity makes the last part
    return path


def _specs(junit: str) -> dict[str, str]:
    """spec name -> passed / failed / skipped, from csi-sanity's JUnit report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "").removeprefix("[It] ")
        if case.find("failure") is not None or case.find("error") is not None:
            out[name] = "failed"
        elif case.find("skipped") is not None:
            out[name] = "skipped"
        else:
            out[name] = "passed"
    return out


def test_csi_sanity_passes_every_identity_and_node_spec(world, plugin, tmp_path):
    assert os.access(SANITY, os.X_OK), (
        f"csi-sanity is not at {SANITY}: the repo must sit beside a copy of shared/ "
        f"(shared/tools/csi-sanity, see shared/tools/README.md)")
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(f"NodePublishVolumeSecret:\n  key: \"{world.key}\"\n")
    source = os.path.join(world.base, "sanity-source")
    os.makedirs(source, exist_ok=True)
    params = tmp_path / "volume.yaml"
    params.write_text(f"source: \"{source}\"\nvolume: sanity\n")
    junit = str(tmp_path / "junit.xml")
    mountdir, stagingdir = _kubelet_dir(world.base, "mount"), _kubelet_dir(world.base, "stage")
    argv = [SANITY, "--csi.endpoint", plugin.endpoint, "--csi.mountdir", mountdir,
            "--csi.stagingdir", stagingdir, "--csi.secrets", str(secrets),
            "--csi.testvolumeparameters", str(params), "--csi.junitfile", junit,
            "--ginkgo.skip", _skip_pattern(), "--ginkgo.no-color", "--ginkgo.v"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    print(run.stdout[-20000:], run.stderr[-4000:])  # shown when the test failed
    specs = {n: s for n, s in _specs(junit).items()
             if n.startswith(("Identity Service", "Node Service"))}
    failed = sorted(n for n, s in specs.items() if s == "failed")
    assert not failed, f"csi-sanity specs failed: {failed}"
    assert run.returncode == 0, f"csi-sanity exited {run.returncode}"
    skipped = {n for n, s in specs.items() if s == "skipped"}
    assert skipped == set(NEEDS_CREATE_VOLUME) | set(SUITE_SKIPS), sorted(skipped)
    passed = sorted(n for n, s in specs.items() if s == "passed")
    print(f"csi-sanity: {len(passed)} Identity and Node specs passed:", *passed, sep="\n  ")
    assert len([n for n in passed if n.startswith("Identity Service")]) == 3, passed
    assert len([n for n in passed if n.startswith("Node Service")]) == 10, passed
