"""Run a rendered pod's containers on this host, without a container runtime.

A stand-in for the kubelet, good enough to check that the manifests' pieces
work together: volumes become directories under a scratch root (hostPath
dirs created root-owned 0755 as DirectoryOrCreate does, emptyDirs 0777,
ConfigMap files 0644, Secret files with their defaultMode), and each
container's paths are mapped onto them by rewriting its command, env and
mounted config files (longest mountPath first). Its securityContext becomes
`setpriv`: runAsUser/runAsGroup, the bounding set from capabilities.add
after drop ALL (required), no_new_privs (allowPrivilegeEscalation: false is
required too); privileged containers run as plain root.

Mounts, when run inside a mount namespace of its own (the "node", see
node_scenario): every container then gets its own mount namespace, where
its readOnly mounts are read-only bind mounts and its mountPropagation is
applied the way the runtime does it (pod volume dirs are shared mounts, as
under the kubelet's rshared root; None -> private, HostToContainer ->
rslave, Bidirectional -> shared, which the API allows only privileged).

What it cannot show: images (commands come from `bin_dir`, a copy of the
package installed for all users: package_install).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.deploy.unit_runner import setpriv

IMAGE_UID = 10001        # the Containerfile's USER, for containers that set no runAsUser


@dataclass
class Pod:
    """One pod spec, its ConfigMaps and Secrets; node paths under `node`, the
    pod's own volumes under `root` (pods of one node share `node`); the
    images' commands in `bin_dir`."""

    spec: dict
    configmaps: dict[str, dict[str, str]]
    secrets: dict[str, dict[str, bytes]]
    node: Path
    root: Path
    bin_dir: Path
    namespaces: bool = False     # per-container mount namespaces (see module doc)
    _dirs: dict[str, Path] = field(default_factory=dict)

    def container(self, name: str) -> dict:
        return next(c for c in self.spec.get("initContainers", []) + self.spec["containers"]
                    if c["name"] == name)

    def host_path(self, path: str) -> Path:
        """Where a node path lives in the scratch root (/dev stays real)."""
        return Path(path) if path.startswith("/dev/") else self.node / path.lstrip("/")

    def volume_dir(self, name: str, owner: dict) -> Path:
        """The host directory (or device) behind volume `name`, created on first use."""
        if name in self._dirs:
            return self._dirs[name]
        vol = next(v for v in self.spec["volumes"] if v["name"] == name)
        if "hostPath" in vol:
            d = self.host_path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type") == "DirectoryOrCreate" and not d.exists():
                d.mkdir(parents=True, mode=0o755)
        elif "emptyDir" in vol:
            d = self.root / "empty" / name
            d.mkdir(parents=True)
            os.chmod(d, 0o777)
            if self.namespaces:    # a shared mount, like everything under the kubelet's root
                subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
                subprocess.run(["mount", "--make-shared", str(d)], check=True)
        elif "configMap" in vol:
            d = self.root / "configmap" / name
            d.mkdir(parents=True)
            for key, text in self.configmaps[vol["configMap"]["name"]].items():
                (d / key).write_text(self.rewrite(text, owner))
                os.chmod(d / key, 0o644)
        elif "secret" in vol:
            d = self.root / "secret" / name
            d.mkdir(parents=True)
            secret_name = vol["secret"]["secretName"]
            if secret_name not in self.secrets and not vol["secret"].get("optional"):
                raise ValueError(f"volume {name}: secret {secret_name} is missing")
            data = self.secrets.get(secret_name, {})   # optional and absent: an empty dir
            for item in vol["secret"].get("items") or [{"key": k, "path": k} for k in data]:
                (d / item["path"]).write_bytes(data[item["key"]])
                os.chmod(d / item["path"], vol["secret"].get("defaultMode", 0o644))
        else:
            raise ValueError(f"volume {name}: type not simulated")
        self._dirs[name] = d
        return d

    def rewrite(self, text: str, c: dict) -> str:
        """Container paths in `text` -> their host directories (one pass, so a
        host path is never rewritten again by a shorter mountPath like /tmp)."""
        hosts = {m["mountPath"]: str(self._dirs[m["name"]])
                 for m in c.get("volumeMounts", []) if m["name"] in self._dirs}
        if not hosts:
            return text
        alternatives = "|".join(re.escape(p) for p in sorted(hosts, key=len, reverse=True))
        pattern = re.compile(rf"(?<![\w/.-])({alternatives})(?=[/\s\"']|$)", re.M)
        return pattern.sub(lambda m: hosts[m.group(1)], text)

    def prepare(self, c: dict) -> None:
        """Create every volume the container mounts; ConfigMaps last, since their
        files are written with the container's paths mapped to the others."""
        names = [m["name"] for m in c.get("volumeMounts", [])]
        is_cm = {v["name"]: "configMap" in v for v in self.spec["volumes"]}
        for name in sorted(names, key=lambda n: is_cm[n]):
            self.volume_dir(name, c)

    def env(self, c: dict) -> dict[str, str]:
        env = {"PATH": f"{self.bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
        for e in c.get("env", []):
            env[e["name"]] = self.rewrite(e["value"], c)
        for src in c.get("envFrom", []):
            ref = src["secretRef"]
            if ref["name"] in self.secrets:
                env.update({k: v.decode() for k, v in self.secrets[ref["name"]].items()})
            elif not ref.get("optional"):
                raise ValueError(f"{c['name']}: secret {ref['name']} is missing")
        return env

    def mount_setup(self, c: dict) -> str:
        """Shell commands that give a fresh mount namespace the container's mounts."""
        steps = []
        shared = {v["name"] for v in self.spec["volumes"] if "emptyDir" in v}
        for m in c.get("volumeMounts", []):
            if str(self._dirs[m["name"]]).startswith("/dev/"):
                continue
            host = shlex.quote(str(self._dirs[m["name"]]))
            mode = m.get("mountPropagation", "None")
            if mode == "Bidirectional":
                assert c.get("securityContext", {}).get("privileged"), \
                    f"{c['name']}: the API rejects Bidirectional in an unprivileged container"
            elif mode == "HostToContainer":
                steps.append(f"mount --make-rslave {host}")
            elif m["name"] in shared:
                steps.append(f"mount --make-private {host}")
            if m.get("readOnly"):
                # Recursive, as runtimes bind volumes: mounts already under it stay
                # visible; a bind of a slave or shared mount keeps its propagation.
                steps.append(f"mount --rbind {host} {host} && mount -o remount,bind,ro {host}")
        return " && ".join(steps) or "true"

    def argv(self, c: dict, command: list[str]) -> list[str]:
        """`command` as the container's securityContext would run it."""
        self.prepare(c)
        words = self._credentials(c, [self.rewrite(w, c) for w in command])
        if not self.namespaces:
            return words
        return ["unshare", "--mount", "--propagation", "unchanged", "sh", "-c",
                self.mount_setup(c) + ' && exec "$@"', "sh", *words]

    def _credentials(self, c: dict, words: list[str]) -> list[str]:
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            return words
        uid = sc.get("runAsUser", IMAGE_UID)
        gid = sc.get("runAsGroup", uid)
        caps = tuple(sc.get("capabilities", {}).get("add", []))
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{c['name']} keeps default caps"
        assert sc.get("allowPrivilegeEscalation") is False, f"{c['name']} may escalate"
        return setpriv(uid, gid, [], words, caps=tuple(f"CAP_{x}" for x in caps))

    def run(self, name: str, command: list[str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a container's command (or another, e.g. a probe's) to completion."""
        c = self.container(name)
        return subprocess.run(self.argv(c, command or c["command"]), env=self.env(c),
                              capture_output=True, text=True, timeout=timeout, cwd="/")

    def start(self, name: str, log: Path) -> subprocess.Popen:
        """Start a long-running container; its output goes to `log`."""
        c = self.container(name)
        with open(log, "wb") as f:
            # a process group of its own: `kill` ends the container whole
            return subprocess.Popen(self.argv(c, c["command"]), env=self.env(c),
                                    stdout=f, stderr=subprocess.STDOUT, cwd="/",
                                    start_new_session=True)

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """Kill a started container as the kubelet does: every process in it
        (SIGKILL to its process group), not only the first."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def probe(self, name: str, kind: str) -> subprocess.CompletedProcess:
        """Run a container's exec probe once."""
        return self.run(name, self.container(name)[kind]["exec"]["command"])
