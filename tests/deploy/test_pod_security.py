"""Pod Security levels of the manifests, by the Standard's controls
(tests/support/deploy/pod_security.py): the training Jobs on the CSI driver
meet "restricted", so their namespace enforces it; what the evaluator
refuses, it refuses naming the control.
"""

from __future__ import annotations

import copy

import pytest

from tests.support.deploy.pod_security import violations, workload_violations
from tests.support.deploy.render import one, pod_spec

ENFORCE = "pod-security.kubernetes.io/enforce"


def controls(found) -> set[tuple[str, str]]:
    return {(v.level, v.control) for v in found}


@pytest.mark.parametrize("which", ["job", "static_job"])
def test_training_jobs_on_the_driver_meet_restricted(which, request):
    found = workload_violations(request.getfixturevalue(which), "restricted")
    assert found == [], "\n".join(map(str, found))


def test_the_example_namespace_enforces_restricted(example_objs, static_objs, job, static_job):
    ns = one(example_objs, "Namespace")
    assert ns["metadata"]["labels"][ENFORCE] == "restricted"
    for obj in [job, static_job, *[o for o in static_objs if o["kind"] == "PersistentVolumeClaim"]]:
        assert obj["metadata"]["namespace"] == ns["metadata"]["name"]


def test_the_sidecar_recipe_needs_a_privileged_namespace(sidecar_job):
    """What the driver spares a training namespace: the sidecar's pod fails
    even baseline, for its privileged container and its host paths."""
    found = controls(workload_violations(sidecar_job, "baseline"))
    assert {("baseline", "Privileged Containers"), ("baseline", "HostPath Volumes")} <= found


def test_the_blockcache_namespace_is_privileged_because_its_pods_must_be(daemon_objs, ds,
                                                                          csi_node):
    ns = one(daemon_objs, "Namespace")
    assert ns["metadata"]["labels"][ENFORCE] == "privileged"
    assert ("baseline", "HostPath Volumes") in controls(workload_violations(ds, "baseline"))
    plugin = controls(workload_violations(csi_node, "baseline"))
    assert {("baseline", "Privileged Containers"), ("baseline", "HostPath Volumes")} <= plugin


@pytest.fixture
def spec(job):
    """A fresh copy of the example Job's pod spec, which meets restricted."""
    return copy.deepcopy(pod_spec(job))


def trainer(spec: dict) -> dict:
    return spec["containers"][0]


def sc(spec: dict) -> dict:
    return trainer(spec).setdefault("securityContext", {})


# (what is changed, the change, the level that refuses it, the control named)
REFUSED = [
    ("a privileged container", lambda s: sc(s).update(privileged=True),
     "baseline", "Privileged Containers"),
    ("a hostPath volume", lambda s: s["volumes"].append(
        {"name": "host", "hostPath": {"path": "/var/lib"}}), "baseline", "HostPath Volumes"),
    ("no runAsNonRoot", lambda s: s["securityContext"].pop("runAsNonRoot"),
     "restricted", "Running as Non-root"),
    ("runAsNonRoot false in a container", lambda s: sc(s).update(runAsNonRoot=False),
     "restricted", "Running as Non-root"),
    ("a Windows HostProcess container", lambda s: sc(s).update(
        windowsOptions={"hostProcess": True}), "baseline", "HostProcess"),
    ("the host's network", lambda s: s.update(hostNetwork=True), "baseline", "Host Namespaces"),
    ("the host's PIDs", lambda s: s.update(hostPID=True), "baseline", "Host Namespaces"),
    ("the host's IPC", lambda s: s.update(hostIPC=True), "baseline", "Host Namespaces"),
    ("CAP_SYS_ADMIN", lambda s: sc(s)["capabilities"].update(add=["SYS_ADMIN"]),
     "baseline", "Capabilities"),
    ("a default capability added", lambda s: sc(s)["capabilities"].update(add=["CHOWN"]),
     "restricted", "Capabilities"),
    ("capabilities not dropped", lambda s: sc(s).pop("capabilities"),
     "restricted", "Capabilities"),
    ("a host port", lambda s: trainer(s).update(ports=[{"containerPort": 80, "hostPort": 80}]),
     "baseline", "Host Ports"),
    ("AppArmor unconfined", lambda s: sc(s).update(appArmorProfile={"type": "Unconfined"}),
     "baseline", "AppArmor"),
    ("SELinux type spc_t", lambda s: sc(s).update(seLinuxOptions={"type": "spc_t"}),
     "baseline", "SELinux"),
    ("SELinux user", lambda s: s["securityContext"].update(seLinuxOptions={"user": "root"}),
     "baseline", "SELinux"),
    ("/proc unmasked", lambda s: sc(s).update(procMount="Unmasked"),
     "baseline", "/proc Mount Type"),
    ("seccomp unconfined", lambda s: sc(s).update(seccompProfile={"type": "Unconfined"}),
     "baseline", "Seccomp"),
    ("no seccomp profile", lambda s: s["securityContext"].pop("seccompProfile"),
     "restricted", "Seccomp"),
    ("an unsafe sysctl", lambda s: s["securityContext"].update(
        sysctls=[{"name": "kernel.msgmax", "value": "65536"}]), "baseline", "Sysctls"),
    ("an NFS volume", lambda s: s["volumes"].append(
        {"name": "nfs", "nfs": {"server": "nfs.example", "path": "/"}}),
     "restricted", "Volume Types"),
    ("privilege escalation allowed", lambda s: sc(s).pop("allowPrivilegeEscalation"),
     "restricted", "Privilege Escalation"),
    ("uid 0", lambda s: sc(s).update(runAsUser=0), "restricted", "Running as Non-root user"),
]


@pytest.mark.parametrize("change,level,control", [r[1:] for r in REFUSED],
                         ids=[r[0] for r in REFUSED])
def test_each_control_refuses_naming_itself(spec, change, level, control):
    change(spec)
    found = violations(spec, level="restricted")
    assert (level, control) in controls(found), found
    # a control of restricted alone leaves baseline met
    if level == "restricted":
        assert violations(spec, level="baseline") == []


def test_a_hostpath_is_refused_by_both_levels(spec):
    spec["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert {("baseline", "HostPath Volumes"), ("restricted", "Volume Types")} <= \
        controls(violations(spec, level="restricted"))


def test_apparmor_annotation_unconfined_is_refused(spec):
    ann = {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}
    assert ("baseline", "AppArmor") in controls(violations(spec, ann, "baseline"))
    ok = {"container.apparmor.security.beta.kubernetes.io/trainer": "localhost/train"}
    assert violations(spec, ok, "restricted") == []


ALLOWED = [
    ("NET_BIND_SERVICE added", lambda s: sc(s)["capabilities"].update(add=["NET_BIND_SERVICE"])),
    ("a safe sysctl", lambda s: s["securityContext"].update(
        sysctls=[{"name": "net.ipv4.ip_local_port_range", "value": "1024 65000"}])),
    ("a Localhost seccomp profile", lambda s: s["securityContext"].update(
        seccompProfile={"type": "Localhost", "localhostProfile": "train.json"})),
    ("seccomp set per container only", lambda s: (
        s["securityContext"].pop("seccompProfile"),
        sc(s).update(seccompProfile={"type": "RuntimeDefault"}))),
    ("runAsNonRoot per container only", lambda s: (
        s["securityContext"].pop("runAsNonRoot"), sc(s).update(runAsNonRoot=True))),
    ("a Windows pod without allowPrivilegeEscalation", lambda s: (
        s.update(os={"name": "windows"}), sc(s).pop("allowPrivilegeEscalation"))),
    ("SELinux container_init_t", lambda s: sc(s).update(
        seLinuxOptions={"type": "container_init_t", "level": "s0:c1,c2"})),
    ("a configMap, emptyDir, projected and ephemeral volume", lambda s: s["volumes"].extend([
        {"name": "a", "configMap": {"name": "x"}}, {"name": "b", "emptyDir": {}},
        {"name": "c", "projected": {"sources": []}},
        {"name": "d", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}])),
]


@pytest.mark.parametrize("change", [a[1] for a in ALLOWED], ids=[a[0] for a in ALLOWED])
def test_what_restricted_allows_passes(spec, change):
    change(spec)
    assert violations(spec, level="restricted") == []


def test_unknown_level_is_an_error(spec):
    with pytest.raises(ValueError, match="level 'strict'"):
        violations(spec, level="strict")


def test_privileged_level_refuses_nothing(sidecar_job):
    assert violations(pod_spec(sidecar_job), level="privileged") == []
