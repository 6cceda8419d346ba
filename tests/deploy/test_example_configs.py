"""Every shipped config loads in the real config loaders, and is documented.

Configs: the bare-metal examples (systemd/), the DaemonSet's ConfigMap source
and the sidecar recipe's volume (daemonset/). The loaders reject unknown keys, so
a key the code does not know fails here, not on a host.
"""

from __future__ import annotations

import re

import pytest

from tests.support.deploy.daemon_config import load_daemon_config
from tests.support.deploy.paths import DAEMONSET, EXAMPLE_SIDECAR, SYSTEMD

DAEMON_CONFIGS = [SYSTEMD / "blockcached.toml.example", DAEMONSET / "blockcached.toml"]
VOLUME_CONFIGS = [SYSTEMD / "volume.toml.example", EXAMPLE_SIDECAR / "volume.toml"]
_ASSIGNMENT = re.compile(r"^\s*#?\s*([A-Za-z_][A-Za-z0-9_]*|\"[^\"]+\")\s*=")
_TABLE = re.compile(r"^\s*#?\s*\[\[?([A-Za-z_]+)\]\]?\s*$")


@pytest.mark.parametrize("path", DAEMON_CONFIGS, ids=lambda p: p.name)
def test_daemon_config_loads(path):
    cfg = load_daemon_config(str(path))
    assert cfg.cache_dirs and cfg.socket == "/run/blockcache/blockcached.sock"


@pytest.mark.parametrize("path", VOLUME_CONFIGS, ids=lambda p: p.name)
def test_volume_config_loads(path):
    config = pytest.importorskip("fsclient.config", reason="fsclient is not installed")
    cfg = config.build_config(config.load_toml(str(path)))
    assert cfg.volume == "imagenet" and cfg.socket == "/run/blockcache/blockcached.sock"


def _uncommented(text: str) -> str:
    return "\n".join(line.lstrip("# ") for line in text.splitlines())


def test_example_configs_show_every_key_the_loaders_know():
    """Keys shown commented out (with their defaults) count as shown."""
    dconfig = pytest.importorskip("blockcached.config", reason="blockcached is not installed")
    vconfig = pytest.importorskip("fsclient.config", reason="fsclient is not installed")
    text = (SYSTEMD / "blockcached.toml.example").read_text()
    shown = {m.group(1) for m in map(_ASSIGNMENT.match, text.splitlines()) if m}
    shown |= {m.group(1) for m in map(_TABLE.match, text.splitlines()) if m}
    assert set(dconfig._FIELDS) | {"cache_dirs", "path", "size", "weight"} <= shown
    text = (SYSTEMD / "volume.toml.example").read_text()
    shown = {m.group(1) for m in map(_ASSIGNMENT.match, text.splitlines()) if m}
    shown |= {m.group(1) for m in map(_TABLE.match, text.splitlines()) if m}
    assert vconfig._KEYS <= shown


@pytest.mark.parametrize("path", [SYSTEMD / "blockcached.toml.example",
                                  SYSTEMD / "volume.toml.example"], ids=lambda p: p.name)
def test_every_key_of_an_example_has_a_comment_above_it(path):
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if _ASSIGNMENT.match(line) and not line.lstrip().startswith("#"):
            block = i
            while (block > 0 and lines[block - 1].strip()
                   and not lines[block - 1].lstrip().startswith("#")):
                block -= 1      # a run of keys shares the comment above it
            assert block > 0 and lines[block - 1].lstrip().startswith("#"), \
                f"{path.name}:{i + 1}: {line.strip()!r} has no comment"
