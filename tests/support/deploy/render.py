"""Render a kustomization into a list of Kubernetes objects (dicts).

With kubectl: `kubectl kustomize DIR`, exactly what `kubectl apply -k` sends.
Without it: the same from PyYAML over the files, for the subset of kustomize
our kustomizations use (resources, configMapGenerator with files, namespace,
images); generated names then lack the content hash, and references to them
are left as written, which is what kustomize rewrites them from.
"""

from __future__ import annotations

import functools
import posixpath
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import yaml

_SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "images"}
_CLUSTER_SCOPED = {"Namespace", "PriorityClass", "CSIDriver", "PersistentVolume"}


def kubectl() -> str | None:
    """Path of kubectl, or None."""
    return shutil.which("kubectl")


def render(directory: Path) -> list[dict]:
    """The objects of the kustomization in `directory` (fresh copies)."""
    if kubectl():
        return [d for d in yaml.safe_load_all(_kustomize(directory)) if d]
    return render_without_kubectl(directory)


@functools.cache
def _kustomize(directory: Path) -> str:
    # One kubectl run per directory and test session: the files do not change.
    return subprocess.run([kubectl(), "kustomize", str(directory)], check=True,
                          capture_output=True, text=True, timeout=60).stdout


def render_without_kubectl(directory: Path) -> list[dict]:
    """PyYAML fallback of `render` (see the module docstring)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kust) - _SUPPORTED
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml uses {sorted(unknown)}, which "
                         f"the PyYAML fallback does not render; install kubectl")
    objs = []
    for res in kust.get("resources", []):
        objs += [d for d in yaml.safe_load_all((directory / res).read_text()) if d]
    for gen in kust.get("configMapGenerator", []):
        data = {}
        for f in gen.get("files", []):
            key, _, name = f.partition("=") if "=" in f else (Path(f).name, "", f)
            data[key] = (directory / name).read_text()
        objs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": gen["name"]}, "data": data})
    images = {i["name"]: i for i in kust.get("images", [])}
    for obj in objs:
        if "namespace" in kust and obj["kind"] not in _CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = kust["namespace"]
        for c in containers(obj):
            img = images.get(c["image"])
            if img:
                c["image"] = f'{img.get("newName", img["name"])}:{img["newTag"]}'
    return objs


def pod_spec(obj: dict) -> dict | None:
    """The pod spec inside a workload object, or None."""
    spec = obj.get("spec", {})
    return spec.get("template", {}).get("spec") if "template" in spec else None


def containers(obj: dict) -> list[dict]:
    """Init and regular containers of a workload object."""
    ps = pod_spec(obj) or {}
    return ps.get("initContainers", []) + ps.get("containers", [])


def one(objs: list[dict], kind: str) -> dict:
    """The only object of `kind`."""
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def named(objs: list[dict], kind: str, name: str) -> dict:
    """The object of `kind` called `name`."""
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, got {len(found)}"
    return found[0]


def configmap_for(objs: list[dict], pod: dict, volume_name: str) -> dict:
    """The rendered ConfigMap that a pod's configMap volume points at."""
    name = volume(pod, volume_name)["configMap"]["name"]
    return next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name)


def volume(pod: dict, name: str) -> dict:
    return next(v for v in pod_spec(pod)["volumes"] if v["name"] == name)


def container(obj: dict, name: str) -> dict:
    return next(c for c in containers(obj) if c["name"] == name)


def mount(c: dict, volume_name: str) -> dict:
    return next(m for m in c.get("volumeMounts", []) if m["name"] == volume_name)


def config_path_arg(c: dict) -> str:
    words = shlex.split(" ".join(c["command"]))
    return words[words.index("--config") + 1]


def daemon_config(daemon_objs, ds) -> dict:
    cm = configmap_for(daemon_objs, ds, "config")
    daemon = container(ds, "blockcached")
    path = config_path_arg(daemon)
    m = mount(daemon, "config")
    assert posixpath.dirname(path) == m["mountPath"], "--config is not in the ConfigMap mount"
    return tomllib.loads(cm["data"][posixpath.basename(path)])
