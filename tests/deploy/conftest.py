"""The rendered manifests, shared by the manifest tests: the daemon's
kustomization (blockcached, the CSI node plugin, the tier) and the three
examples (the driver's inline volume, its static PV, the sidecar recipe)."""

from __future__ import annotations

import pytest

from tests.support.deploy.paths import DAEMONSET, EXAMPLE, EXAMPLE_SIDECAR, EXAMPLE_STATIC
from tests.support.deploy.render import named, one, render


@pytest.fixture(scope="module")
def daemon_objs():
    return render(DAEMONSET)


@pytest.fixture(scope="module")
def example_objs():
    return render(EXAMPLE)


@pytest.fixture(scope="module")
def static_objs():
    return render(EXAMPLE_STATIC)


@pytest.fixture(scope="module")
def sidecar_objs():
    return render(EXAMPLE_SIDECAR)


@pytest.fixture(scope="module")
def ds(daemon_objs):
    return named(daemon_objs, "DaemonSet", "blockcached")


@pytest.fixture(scope="module")
def csi_node(daemon_objs):
    return named(daemon_objs, "DaemonSet", "blockcache-csi-node")


@pytest.fixture(scope="module")
def csi_keepers(daemon_objs):
    """The CSI driver's keeper host (csi-keepers.yaml)."""
    return named(daemon_objs, "DaemonSet", "blockcache-csi-keepers")


@pytest.fixture(scope="module")
def memcached(daemon_objs):
    return named(daemon_objs, "DaemonSet", "blockcache-memcached")


@pytest.fixture(scope="module")
def job(example_objs):
    """The training Job on an inline CSI volume (daemonset/example/)."""
    return one(example_objs, "Job")


@pytest.fixture(scope="module")
def static_job(static_objs):
    return one(static_objs, "Job")


@pytest.fixture(scope="module")
def sidecar_job(sidecar_objs):
    """The training Job with the privileged fsclient sidecar (example-sidecar/)."""
    return one(sidecar_objs, "Job")
