"""A copy of this package installed where any user can run it, as under /opt.

Units and pods run blockcached, fsclient and blockcache-cli as other users
(nobody, 10001, ...). The venv that runs the tests may be unreachable for
them: a checkout in root's home or in a `mktemp -d` dir (mode 0700), or an
interpreter under /root/.pyenv. So `bin_dir` builds, once per process, a
venv in a scratch dir with modes set explicitly (dirs 0755, files 0644 or
0755): the checkout's packages, the runtime dependencies the test venv holds
(the extras the Containerfile installs), and console scripts for the
entry points, on an interpreter the service user can run with its own
standard library. Nothing depends on the modes of the checkout's parents.
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata as md
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# A module, not its names: unit_runner imports this module (through units).
from tests.support.deploy import unit_runner
from tests.support.deploy.paths import REPO

DIST = "blockcache"
EXTRAS = ("fuse", "s3", "metrics")     # what daemonset/Containerfile installs
# What an interpreter reports about itself; a user who cannot read its prefix
# sees another (Python falls back to /usr), so the answers then differ.
IDENTITY = "import json, sys; print(json.dumps([sys.base_prefix, list(sys.version_info[:2])]))"


@functools.cache
def bin_dir() -> Path:
    """The bin/ of the scratch install (built on first use, removed at exit)."""
    scratch = Path(tempfile.mkdtemp(prefix="blockcache-opt-"))
    atexit.register(shutil.rmtree, scratch, True)
    os.chmod(scratch, 0o755)
    venv = scratch / "venv"
    subprocess.run([str(interpreter()), "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True, text=True, timeout=60)
    [site] = venv.glob("lib/python3*/site-packages")
    for dist in runtime_distributions():
        copy_distribution(dist, site)
    copy_project(site)
    write_scripts(venv / "bin")
    open_to_all(scratch)
    check_usable(venv / "bin" / "python")
    return venv / "bin"


def interpreter() -> Path:
    """An interpreter of this Python version that the service user runs as
    root does: the test venv's base if it can, else the system's."""
    version = list(sys.version_info[:2])
    name = f"python{version[0]}.{version[1]}"
    ours = sys._base_executable   # noqa: SLF001 - the venv's base interpreter
    system = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
    tried = []
    for path in dict.fromkeys(c for c in (ours, system) if c):
        mine = identity([path])
        if mine and mine[1] == version and identity(as_service_user([path])) == mine:
            return Path(path)
        tried.append(path)
    raise RuntimeError(
        f"no {name} that the service user can run with its standard library (tried {tried}): "
        f"install one where all users can read it (e.g. /usr/bin), or make the test venv "
        f"from such an interpreter")


def as_service_user(argv: list[str]) -> list[str]:
    return unit_runner.setpriv(unit_runner.SERVICE_UID, unit_runner.SERVICE_GID, [], argv)


def identity(argv: list[str]) -> list | None:
    try:
        out = subprocess.run([*argv, "-I", "-c", IDENTITY], capture_output=True, text=True,
                             timeout=60, cwd="/")
    except OSError:
        return None
    return json.loads(out.stdout) if out.returncode == 0 else None


def runtime_distributions() -> list[md.Distribution]:
    """The installed distributions the package needs with EXTRAS, recursively."""
    found: dict[str, md.Distribution] = {}
    todo = [(DIST, set(EXTRAS))]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in found:
            continue
        try:
            dist = found[key] = md.distribution(name)
        except md.PackageNotFoundError:
            continue    # an extra the test venv lacks: the tests needing it skip
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e})
                                         for e in extras or {""}):
                todo.append((req.name, set(req.extras)))
    del found[canonicalize_name(DIST)]     # copied from the checkout instead
    return list(found.values())


def copy_distribution(dist: md.Distribution, site: Path) -> None:
    """Copy a distribution's files (its RECORD) that live in site-packages."""
    for rel in dist.files or []:
        if rel.parts[0] == "..":        # scripts in bin/: not needed, not ours to copy
            continue
        src = Path(dist.locate_file(rel))
        if src.is_file():
            dest = site / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)


def copy_project(site: Path) -> None:
    """The checkout's packages (bytecode too: copy2 keeps the mtimes that
    validate it) and the metadata that names their entry points."""
    dist = md.distribution(DIST)
    for package in dist.read_text("top_level.txt").split():
        shutil.copytree(REPO / package, site / package)
    info = site / f"{DIST}-{dist.version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(dist.read_text("METADATA") or dist.read_text("PKG-INFO"))
    for name in ("entry_points.txt", "top_level.txt"):
        (info / name).write_text(dist.read_text(name))


def write_scripts(bin_path: Path) -> None:
    """Console scripts for the entry points, as pip writes them."""
    for ep in md.distribution(DIST).entry_points.select(group="console_scripts"):
        module, _, attr = ep.value.partition(":")
        script = bin_path / ep.name
        script.write_text(f"#!{bin_path / 'python'}\nimport sys\nfrom {module} import {attr}\n"
                          f"if __name__ == '__main__':\n    sys.exit({attr}())\n")
        script.chmod(0o755)


def open_to_all(top: Path) -> None:
    """Dirs 0755, files 0644 (0755 if executable), whatever the umask was."""
    for d, _dirs, files in os.walk(top):
        os.chmod(d, 0o755)
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                os.chmod(p, 0o755 if os.stat(p).st_mode & stat.S_IXUSR else 0o644)


def check_usable(python: Path) -> None:
    """The service user imports what the units and pods run."""
    probe = subprocess.run(
        as_service_user([str(python), "-c", "import blockcached.__main__, fsclient.cli, "
                                            "blockcache_client.cli"]),
        capture_output=True, text=True, timeout=120, cwd="/")
    if probe.returncode != 0:
        raise RuntimeError(f"the service user cannot use the scratch install {python}:\n"
                           f"{probe.stderr}")
