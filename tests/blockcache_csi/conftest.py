"""Fixtures for the CSI plugin's tests: one real blockcached, a source tree,
a volume key, a keeper host and a plugin process shared by the module, with
every mount and process under the module's dir removed at teardown, whatever
happened (CSI_TEST_KEEP=1 keeps the dir's logs for a look). What they
share is a `World` (tests/support/csi_world.py)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.support.csi_plugin import running
from tests.support.csi_world import World
from tests.support.leftovers import cleanup, remove_keeper_cgroups
from tests.support.nobody_python import server_python


@pytest.fixture(scope="module")
def world():
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse")
    base = tempfile.mkdtemp(prefix="bc-csi-")
    os.chmod(base, 0o755)
    found = server_python(base)
    if found is None:
        cleanup(base)
        pytest.skip("no Python that uid nobody may run with this checkout's packages")
    w = World(base, *found)
    try:
        w.daemon.start()
        yield w
    finally:
        try:
            cleanup(base, spare=(w.daemon.proc.pid,) if w.daemon.proc else ())
            remove_keeper_cgroups(base)
        finally:
            w.daemon.stop()
            if not os.environ.get("CSI_TEST_KEEP"):
                shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def keepers(world):
    """The keeper host every plugin of the module asks (at world.keepers_socket)."""
    with running(world.keeper_host().start()) as host:
        yield host


@pytest.fixture(scope="module")
def plugin(world, keepers):
    with running(world.plugin().start()) as p:
        yield p
