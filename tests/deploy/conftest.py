"""The rendered manifests, shared by the manifest tests: the daemon's
kustomization (both DaemonSets) and the example training Job's."""

from __future__ import annotations

import pytest

from tests.support.deploy.paths import DAEMONSET, EXAMPLE
from tests.support.deploy.render import named, one, render


@pytest.fixture(scope="module")
def daemon_objs():
    return render(DAEMONSET)


@pytest.fixture(scope="module")
def example_objs():
    return render(EXAMPLE)


@pytest.fixture(scope="module")
def ds(daemon_objs):
    return named(daemon_objs, "DaemonSet", "blockcached")


@pytest.fixture(scope="module")
def memcached(daemon_objs):
    return named(daemon_objs, "DaemonSet", "blockcache-memcached")


@pytest.fixture(scope="module")
def job(example_objs):
    return one(example_objs, "Job")
