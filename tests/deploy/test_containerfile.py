"""The Containerfile builds what the manifests run (checked without a build).

No container engine runs here, so this reads the Containerfile: a pinned
base, the project with the extras the pods need, fuse3, a non-root user
that is the DaemonSet's, and a build context that holds every package.
"""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.support.deploy.paths import DAEMONSET, EXAMPLES, REPO
from tests.support.deploy.render import containers, named, pod_spec, render

CONTAINERFILE = DAEMONSET / "Containerfile"
IGNORE = DAEMONSET / "Containerfile.dockerignore"
CSI_PLUGIN = "blockcache-csi"


@pytest.fixture(scope="module")
def lines():
    text = CONTAINERFILE.read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def final_stage(lines: list[str]) -> list[str]:
    last = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    return lines[last:]


def test_base_images_are_pinned(lines):
    args = dict(re.match(r"ARG (\w+)=(\S+)", line).groups() for line in lines
                if re.match(r"ARG \w+=", line))
    froms = [line.split()[1] for line in lines if line.startswith("FROM ")]
    assert len(froms) >= 2, "expected a build stage and a runtime stage"
    for ref in froms:
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)
        pinned = "@sha256:" in ref or re.search(r":\d+\.\d+\.\d+(-[a-z0-9-]+)?$", ref)
        assert pinned, f"base image {ref} is neither a digest nor an exact release"


def test_installs_the_project_with_the_extras_pods_need(lines, pyproject):
    wheel = next(line for line in lines if "pip wheel" in line)
    extras = set(re.search(r"\[([a-z0-9_,]+)\]", wheel).group(1).split(","))
    assert {"s3", "metrics"} <= extras
    assert extras <= set(pyproject["project"]["optional-dependencies"])
    assert any("apt-get install" in line and " fuse3" in line for line in final_stage(lines))
    # fsclient speaks FUSE itself: nothing is compiled, no libfuse headers
    assert not any(re.search(r"\b(gcc|libfuse3-dev|pkg-config)\b", line) for line in lines)


def test_build_context_holds_every_package(lines, pyproject):
    assert "COPY . /src" in lines
    keep = {line[1:] for line in IGNORE.read_text().splitlines() if line.startswith("!")}
    assert "pyproject.toml" in keep
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        pkg = pattern.rstrip("*")
        assert pkg in keep, f"package {pkg} is left out of the build context"


def test_runs_as_the_daemonsets_non_root_user(lines):
    users = [line.split()[1] for line in final_stage(lines) if line.startswith("USER ")]
    assert users, "the image runs as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0
    ds = named(render(DAEMONSET), "DaemonSet", "blockcached")
    daemon = next(c for c in pod_spec(ds)["containers"] if c["name"] == "blockcached")
    assert daemon["securityContext"]["runAsUser"] == int(uid)
    assert daemon["securityContext"]["runAsGroup"] == int(gid or uid)
    chown = next(c for c in containers(ds) if c["command"][0] == "chown")
    assert chown["command"][1] == f"{uid}:{gid or uid}"


def commands_the_manifests_run() -> dict[str, set[str]]:
    """Our programs each container runs, by container name (probes too)."""
    out: dict[str, set[str]] = {}
    for directory in (DAEMONSET, *EXAMPLES):
        for obj in render(directory):
            for c in containers(obj):
                words = " ".join(c.get("command", [])).split()
                for probe in ("readinessProbe", "livenessProbe"):
                    words += c.get(probe, {}).get("exec", {}).get("command", [])[:1]
                out.setdefault(c["name"], set()).update(
                    w for w in words if w.startswith(("blockcache", "fsclient")))
    return out


def test_commands_the_manifests_run_are_the_projects_scripts(pyproject):
    scripts = set(pyproject["project"]["scripts"])
    for name, ours in commands_the_manifests_run().items():
        ours -= {CSI_PLUGIN}                  # its own test, below
        assert ours <= scripts, f"{name} runs {ours - scripts}, not in the image"


def test_the_image_has_the_csi_plugin_and_its_grpc_runtime(lines, pyproject):
    """The CSI node plugin (csi-node.yaml) runs from this image too."""
    assert {CSI_PLUGIN} in commands_the_manifests_run().values()
    pytest.importorskip("blockcache_csi", reason="the CSI plugin's package blockcache_csi "
                                                 "is not in this tree")
    assert CSI_PLUGIN in pyproject["project"]["scripts"]
    wheel = next(line for line in lines if "pip wheel" in line)
    extras = re.search(r"\[([a-z0-9_,]+)\]", wheel).group(1).split(",")
    installed = list(pyproject["project"]["dependencies"])
    for extra in extras:
        installed += pyproject["project"]["optional-dependencies"][extra]
    assert any(re.match(r"grpcio\b(?!-)", dep) for dep in installed), \
        "grpcio is neither a dependency nor in an extra the image installs"


def test_the_image_has_the_memcached_the_tier_runs(lines):
    """The cluster tier's DaemonSet runs Debian's memcached from this image."""
    mc = named(render(DAEMONSET), "DaemonSet", "blockcache-memcached")
    (c,) = [c for c in pod_spec(mc)["containers"] if "exec memcached" in " ".join(c["command"])]
    assert c["image"].split(":")[0] == "blockcache"
    assert any("apt-get install" in line and " memcached" in line for line in final_stage(lines))
