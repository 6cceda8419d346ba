"""Fixtures for the CSI plugin's tests: one real blockcached, a source tree,
a volume key and a plugin process shared by the module, with every mount and
process under the module's dir removed at teardown, whatever happened
(CSI_TEST_KEEP=1 keeps the dir's logs for a look)."""

from __future__ import annotations

import os
import random
import shutil
import tempfile

import pytest

from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess
from tests.csi.plugin import Plugin, cleanup, kubelet_keys, server_python, socket_group

BLOCK = "256K"


def make_source(root: str) -> None:
    rng = random.Random(32)
    for d in range(2):
        sub = os.path.join(root, f"dir{d}")
        os.makedirs(sub)
        for i, size in enumerate((0, 4095, 300 << 10, 1 << 20)):
            with open(os.path.join(sub, f"f{i}.bin"), "wb") as f:
                f.write(rng.randbytes(size))
    with open(os.path.join(root, "big.bin"), "wb") as f:
        f.write(rng.randbytes(3 * (1 << 20) + 123))


class World:
    """What the tests share: dirs, daemon, source, key, interpreter."""

    def __init__(self, base: str, python: str, env: dict[str, str]):
        self.base, self.python, self.env = base, python, env
        self.source = os.path.join(base, "source")
        make_source(self.source)
        # the kubelet's pod dirs: 0750 root, which the server may not search
        self.pods = os.path.join(base, "pods")
        os.makedirs(self.pods, 0o750)
        os.chmod(self.pods, 0o750)
        key_path = os.path.join(base, "volume.key")
        generate_key_file(key_path)
        with open(key_path) as f:
            self.key = f.read().strip()
        self.socket_gid = socket_group()
        self.daemon = DaemonProcess(base, extra_args=["--socket-group", str(self.socket_gid)])
        self.targets = 0

    def target(self) -> str:
        self.targets += 1
        parent = os.path.join(self.pods, f"pod{self.targets}", "volumes")
        os.makedirs(parent)
        return os.path.join(parent, "mount")

    def context(self, volume: str = "data", namespace: str = "default",
                **more: str) -> dict[str, str]:
        """A volume_context as the kubelet sends it for an inline volume of a
        pod in `namespace`."""
        return {"source": self.source, "volume": volume, "blockSize": BLOCK,
                **kubelet_keys(namespace), **more}

    def plugin(self, state: str = "state", name: str = "plugin",
               args: tuple[str, ...] = (), env: dict[str, str] | None = None, **kw) -> Plugin:
        """A plugin that allows `self.source` to every namespace, and `args`;
        `env`: added to its environment."""
        return Plugin(self.python, {**self.env, **(env or {})}, self.base,
                      os.path.join(self.base, state),
                      self.daemon.socket_path, os.path.join(self.base, f"{name}.log"),
                      name=name, args=("--allow-source", self.source, *args), **kw)


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
        finally:
            w.daemon.stop()
            if not os.environ.get("CSI_TEST_KEEP"):
                shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def plugin(world):
    p = world.plugin().start()
    try:
        yield p
    finally:
        p.stop()
        print(p.log())  # shown when a test failed
