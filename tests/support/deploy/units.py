"""Install the systemd units into a staging root and read them back.

`install` runs the real `make install-systemd` with DESTDIR, pointing BINDIR
at a copy of the package that any user can run (package_install), so
ExecStart= names binaries that exist (systemd-analyze verify insists) and the
unit tests can run ExecStart= as the units' users.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# A module, not its names: package_install imports unit_runner, which imports this.
from tests.support.deploy import package_install
from tests.support.deploy.paths import REPO

UNITDIR = "usr/local/lib/systemd/system"
ETC = "etc/blockcache"


@dataclass(frozen=True)
class Installed:
    """Paths of one `make install-systemd DESTDIR=root`."""

    root: Path

    @property
    def unitdir(self) -> Path:
        return self.root / UNITDIR

    @property
    def etc(self) -> Path:
        return self.root / ETC

    def unit(self, name: str) -> Path:
        return self.unitdir / name


def install(root: Path) -> Installed:
    """Run `make install-systemd` into `root`; CalledProcessError shows make's output."""
    if not shutil.which("make"):
        raise RuntimeError("make is not installed")
    # Under `make test` the parent's variables arrive through MAKEFLAGS (and
    # PREFIX & co. may be in the environment): pin the layout this module reads.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL")}
    subprocess.run(["make", "-s", "-C", str(REPO), "install-systemd", f"DESTDIR={root}",
                    f"BINDIR={package_install.bin_dir()}", "PREFIX=/usr/local", "SYSCONFDIR=/etc",
                    f"UNITDIR=/{UNITDIR}", "DOCDIR=/usr/local/share/doc/blockcache"],
                   check=True, capture_output=True, text=True, timeout=60, env=env)
    return Installed(root)


def parse_unit(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in order (keys may repeat)."""
    out, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not an assignment: {raw!r}"
        out.append((section, key.strip(), value.strip()))
    return out


def values(path: Path, key: str, section: str = "Service") -> list[str]:
    """Every value assigned to `key` in `section`."""
    return [v for s, k, v in parse_unit(path) if s == section and k == key]


def value(path: Path, key: str, section: str = "Service") -> str:
    """The last value assigned to `key` (what systemd uses for single-valued keys)."""
    found = values(path, key, section)
    assert found, f"{path.name}: [{section}] {key}= is not set"
    return found[-1]


def exec_start(path: Path) -> list[str]:
    """ExecStart= split into argv."""
    return shlex.split(value(path, "ExecStart"))
