"""A Python that uid nobody can run this checkout with: for tests whose FUSE
servers run unprivileged (the CSI plugin's, fsclient's `--server-user`)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

from tests.support.fsclient_mounts import REPO
from tests.support.uids import NOBODY


def _nobody_can(paths: list[str]) -> bool:
    """Whether uid nobody may read (and search or run) every one of `paths`,
    asked of test(1) run as nobody (no fork of this threaded process)."""
    for p in paths:
        ok = subprocess.run(["test", "-r", p, "-a", "-x", p], user=NOBODY.pw_uid,
                            group=NOBODY.pw_gid, extra_groups=[], timeout=30,
                            capture_output=True)
        if ok.returncode != 0:
            return False
    return True


def server_python(base: str) -> tuple[str, dict[str, str]] | None:
    """(interpreter, environment) with which uid nobody can run this checkout:
    this one if nobody may run it (a container image), else the system's
    Python of the same version with this venv's packages on PYTHONPATH (a
    pyenv under /root is shut to other uids). A checkout nobody cannot reach
    (a clone under 0700 /root, as CI's) is seen through a read-only bind
    mount at `base`/repo, which `cleanup` removes. None if there is none."""
    repo, site = REPO, sysconfig.get_paths()["purelib"]
    here = os.path.realpath(sys.executable)
    stdlib = sysconfig.get_paths()["stdlib"]
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not _nobody_can([repo]) and site.startswith(REPO + "/"):
        repo = os.path.join(base, "repo")
        os.mkdir(repo)
        # read-only: nothing under `base` may ever delete the checkout
        for cmd in (["mount", "--bind", REPO, repo],
                    ["mount", "-o", "remount,bind,ro", repo]):
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        site = repo + site[len(REPO):]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, site]))
    env.pop("PYTHONHOME", None)
    if _nobody_can([here, stdlib, repo, site]):
        return sys.executable, env
    if os.path.exists(system) and _nobody_can([system, repo, site]):
        return system, env
    return None
