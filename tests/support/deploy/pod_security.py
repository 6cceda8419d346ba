"""Which Pod Security Standard a pod spec meets, by the controls of the
baseline and restricted profiles as kubernetes.io defines them
(docs/concepts/security/pod-security-standards, the "latest" version that
Pod Security admission enforces): each control reads the same fields and
allows the same values. Enough to check ours; Windows pods are exempt from
the controls the Standard exempts them from.

`violations(pod_spec, annotations, "restricted")` lists what a namespace
labelled `pod-security.kubernetes.io/enforce: restricted` would refuse, each
naming its control.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

LEVELS = ("privileged", "baseline", "restricted")

# Baseline "Capabilities": what may be added (the container runtimes' defaults).
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}
# Baseline "Sysctls": the safe, namespaced ones.
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}
PROFILE_TYPES = {"RuntimeDefault", "Localhost"}           # seccomp and AppArmor alike
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
# Restricted "Volume Types": the only volume sources a pod may use.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


@dataclass(frozen=True)
class Violation:
    level: str          # the lowest level that refuses it
    control: str        # the Standard's name for the control
    detail: str         # the field and its value

    def __str__(self) -> str:
        return f"{self.level} / {self.control}: {self.detail}"


def _containers(spec: dict) -> Iterator[tuple[str, dict]]:
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(kind) or []):
            yield f"spec.{kind}[{i}] ({c.get('name')})", c


def _sc(obj: dict) -> dict:
    return obj.get("securityContext") or {}


def _contexts(spec: dict) -> Iterator[tuple[str, dict]]:
    """The pod's securityContext, then every container's."""
    yield "spec.securityContext", _sc(spec)
    for where, c in _containers(spec):
        yield f"{where}.securityContext", _sc(c)


def _windows(spec: dict) -> bool:
    return (spec.get("os") or {}).get("name") == "windows"


# Baseline controls ---------------------------------------------------------

def host_process(spec, _annotations):
    for where, sc in _contexts(spec):
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            yield f"{where}.windowsOptions.hostProcess=true"


def host_namespaces(spec, _annotations):
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            yield f"spec.{field}=true"


def privileged_containers(spec, _annotations):
    for where, c in _containers(spec):
        if _sc(c).get("privileged"):
            yield f"{where}.securityContext.privileged=true"


def baseline_capabilities(spec, _annotations):
    for where, c in _containers(spec):
        added = set((_sc(c).get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            yield f"{where} adds {sorted(added - BASELINE_CAPABILITIES)}"


def host_path_volumes(spec, _annotations):
    for v in spec.get("volumes") or []:
        if "hostPath" in v:
            yield f"volume {v['name']} is a hostPath ({v['hostPath'].get('path')})"


def host_ports(spec, _annotations):
    for where, c in _containers(spec):
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                yield f"{where} hostPort {p['hostPort']}"


def _unconfined(spec: dict, field: str) -> Iterator[str]:
    """A seccomp or AppArmor profile set, at any level, to other than the
    runtime's default or a node's profile."""
    for where, sc in _contexts(spec):
        kind = (sc.get(field) or {}).get("type")
        if kind is not None and kind not in PROFILE_TYPES:
            yield f"{where}.{field}.type={kind}"


def apparmor(spec, annotations):
    yield from _unconfined(spec, "appArmorProfile")
    for key, value in (annotations or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and not (
                value == "runtime/default" or value.startswith("localhost/")):
            yield f"annotation {key}={value}"


def selinux(spec, _annotations):
    for where, sc in _contexts(spec):
        opts = sc.get("seLinuxOptions") or {}
        if opts.get("type", "") not in SELINUX_TYPES:
            yield f"{where}.seLinuxOptions.type={opts['type']}"
        for field in ("user", "role"):
            if opts.get(field):
                yield f"{where}.seLinuxOptions.{field}={opts[field]}"


def proc_mount(spec, _annotations):
    for where, c in _containers(spec):
        mount = _sc(c).get("procMount")
        if mount not in (None, "Default"):
            yield f"{where}.securityContext.procMount={mount}"


def baseline_seccomp(spec, _annotations):
    yield from _unconfined(spec, "seccompProfile")


def sysctls(spec, _annotations):
    for s in _sc(spec).get("sysctls") or []:
        if s["name"] not in SAFE_SYSCTLS:
            yield f"spec.securityContext.sysctls {s['name']}"


# Restricted controls -------------------------------------------------------

def volume_types(spec, _annotations):
    for v in spec.get("volumes") or []:
        sources = set(v) - {"name"}
        if sources - RESTRICTED_VOLUMES:
            yield f"volume {v['name']} is a {', '.join(sorted(sources))}"


def privilege_escalation(spec, _annotations):
    if _windows(spec):
        return
    for where, c in _containers(spec):
        if _sc(c).get("allowPrivilegeEscalation") is not False:
            yield f"{where}.securityContext.allowPrivilegeEscalation is not false"


def running_as_non_root(spec, _annotations):
    pod_level = _sc(spec).get("runAsNonRoot")
    if pod_level is False:
        yield "spec.securityContext.runAsNonRoot=false"
    for where, c in _containers(spec):
        value = _sc(c).get("runAsNonRoot")
        if value is False or (value is None and pod_level is not True):
            yield f"{where}.securityContext.runAsNonRoot is not true (nor the pod's)"


def running_as_non_root_user(spec, _annotations):
    for where, sc in _contexts(spec):
        if sc.get("runAsUser") == 0:
            yield f"{where}.runAsUser=0"


def restricted_seccomp(spec, _annotations):
    if _windows(spec):
        return
    pod_level = (_sc(spec).get("seccompProfile") or {}).get("type")
    for where, c in _containers(spec):
        kind = (_sc(c).get("seccompProfile") or {}).get("type", pod_level)
        if kind not in PROFILE_TYPES:
            yield f"{where} seccomp profile is {kind or 'unset'} (and the pod's too)"


def restricted_capabilities(spec, _annotations):
    if _windows(spec):
        return
    for where, c in _containers(spec):
        caps = _sc(c).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            yield f"{where} does not drop ALL capabilities"
        added = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            yield f"{where} adds {sorted(added)}"


Control = Callable[[dict, dict], Iterator[str]]

CONTROLS: list[tuple[str, str, Control]] = [
    ("baseline", "HostProcess", host_process),
    ("baseline", "Host Namespaces", host_namespaces),
    ("baseline", "Privileged Containers", privileged_containers),
    ("baseline", "Capabilities", baseline_capabilities),
    ("baseline", "HostPath Volumes", host_path_volumes),
    ("baseline", "Host Ports", host_ports),
    ("baseline", "AppArmor", apparmor),
    ("baseline", "SELinux", selinux),
    ("baseline", "/proc Mount Type", proc_mount),
    ("baseline", "Seccomp", baseline_seccomp),
    ("baseline", "Sysctls", sysctls),
    ("restricted", "Volume Types", volume_types),
    ("restricted", "Privilege Escalation", privilege_escalation),
    ("restricted", "Running as Non-root", running_as_non_root),
    ("restricted", "Running as Non-root user", running_as_non_root_user),
    ("restricted", "Seccomp", restricted_seccomp),
    ("restricted", "Capabilities", restricted_capabilities),
]


def violations(spec: dict, annotations: dict | None = None,
               level: str = "restricted") -> list[Violation]:
    """What the Standard at `level` refuses in a pod spec (and the pod's
    annotations); [] if the pod meets it."""
    if level not in LEVELS:
        raise ValueError(f"level {level!r}: one of {LEVELS}")
    applies = LEVELS[1:LEVELS.index(level) + 1]
    return [Violation(lvl, name, detail) for lvl, name, control in CONTROLS if lvl in applies
            for detail in control(spec, annotations or {})]


def workload_violations(obj: dict, level: str = "restricted") -> list[Violation]:
    """`violations` of a workload's pod template (Job, DaemonSet, ...)."""
    template = obj["spec"]["template"]
    return violations(template["spec"], (template.get("metadata") or {}).get("annotations"),
                      level)
