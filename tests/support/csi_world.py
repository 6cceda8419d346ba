"""What the CSI plugin's tests share (`World`): one 0755 dir outside pytest's
0700 tree holding a real blockcached, a source tree, a volume key and the
kubelet's pod dirs, and the plugins and keeper hosts started in it. Targets
have the kubelet's shape and length (over 150 bytes)."""

from __future__ import annotations

import os
import random
import uuid

from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess
from tests.support.csi_plugin import KeeperHost, Plugin, kubelet_keys
from tests.support.uids import socket_group

BLOCK = "256K"
MIN_TARGET = 150  # the CSI spec: at least 128 bytes; the kubelet's are about 131


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
        self.pods = os.path.join(base, "var/lib/kubelet/pods")
        os.makedirs(self.pods, 0o750)
        os.chmod(self.pods, 0o750)
        self.keepers_socket = os.path.join(base, "keepers", "keepers.sock")
        key_path = os.path.join(base, "volume.key")
        generate_key_file(key_path)
        with open(key_path) as f:
            self.key = f.read().strip()
        self.socket_gid = socket_group()
        self.daemon = DaemonProcess(base, extra_args=["--socket-group", str(self.socket_gid)])
        self.targets = 0

    def target(self) -> str:
        """A target as the kubelet's pkg/volume/csi makes it for a PV: PODS/<pod
        uid>/volumes/kubernetes.io~csi/<pv name>/mount."""
        self.targets += 1
        parent = os.path.join(self.pods, str(uuid.uuid4()), "volumes", "kubernetes.io~csi",
                              f"pvc-{uuid.uuid4()}")
        os.makedirs(parent)
        target = os.path.join(parent, "mount")
        assert len(target) >= MIN_TARGET, target
        return target

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
        kw.setdefault("keepers", self.keepers_socket)
        return Plugin(self.python, {**self.env, **(env or {})}, self.base,
                      os.path.join(self.base, state),
                      self.daemon.socket_path, os.path.join(self.base, f"{name}.log"),
                      name=name, args=("--allow-source", self.source, *args), **kw)

    def keeper_host(self, name: str = "keepers", socket_path: str | None = None,
                    **kw) -> KeeperHost:
        return KeeperHost(self.python, self.env, self.base, socket_path or self.keepers_socket,
                          os.path.join(self.base, f"{name}.log"), **kw)
