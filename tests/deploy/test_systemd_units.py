"""The systemd units install, verify, and keep their promises.

Installed with the real `make install-systemd` into a staging root; checked
with systemd's own tools (`systemd-analyze verify`, `security`,
`systemd-sysusers`) where they exist, skipped with the reason where not.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tomllib

import pytest

from fsclient.keeper import handoff
from tests.support.deploy.package_install import bin_dir
from tests.support.deploy.paths import SYSTEMD
from tests.support.deploy.units import exec_start, install, parse_unit, value, values

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")

# Unit -> how systemd-analyze names it (a template is verified as an instance),
# and the highest `systemd-analyze security` exposure (x10) we accept.
UNITS = {
    "blockcached.service": ("blockcached.service", 25),
    "fsclient@.service": ("fsclient@.service:fsclient@imagenet.service", 50),
}
# Settings that give a service its own mount namespace (the *Directory= ones
# in some systemd versions or combinations): a FUSE mount made in there would
# be invisible to the host.
MOUNT_NAMESPACE_SETTINGS = {
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
    "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths",
    "BindPaths", "BindReadOnlyPaths", "TemporaryFileSystem", "MountFlags",
    "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
    "ProtectControlGroups", "ProtectProc", "ProcSubset", "RootDirectory", "RootImage",
    "MountAPIVFS", "PrivateUsers", "DynamicUser", "LogsDirectory", "StateDirectory",
    "CacheDirectory", "RuntimeDirectory", "ConfigurationDirectory",
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return install(tmp_path_factory.mktemp("root"))


def test_install_puts_units_configs_and_user_in_place(installed):
    for unit in UNITS:
        assert installed.unit(unit).is_file()
        assert stat.S_IMODE(installed.unit(unit).stat().st_mode) == 0o644
    # ExecStart= names the binaries where BINDIR says they are.
    for unit, script in (("blockcached.service", "blockcached"), ("fsclient@.service", "fsclient")):
        assert exec_start(installed.unit(unit))[0] == str(bin_dir() / script)
    etc = installed.etc
    example = (SYSTEMD / "blockcached.toml.example").read_text()
    assert (etc / "blockcached.toml").read_text() == example
    assert (etc / "blockcached.toml.example").is_file()
    assert (etc / "volumes" / "volume.toml.example").is_file()
    assert stat.S_IMODE((etc / "keys").stat().st_mode) == 0o700
    assert (installed.root / "etc/sysusers.d/blockcache.conf").is_file()


def test_install_never_overwrites_a_config(tmp_path):
    first = install(tmp_path)
    cfg = first.etc / "blockcached.toml"
    cfg.write_text("# the operator's own config\n")
    (first.etc / "blockcached.toml.example").write_text("stale example\n")
    install(tmp_path)
    assert cfg.read_text() == "# the operator's own config\n"
    assert (first.etc / "blockcached.toml.example").read_text() == \
        (SYSTEMD / "blockcached.toml.example").read_text()


@needs_analyze
@pytest.mark.parametrize("unit", list(UNITS))
def test_unit_passes_systemd_analyze_verify(installed, unit):
    name = UNITS[unit][0].replace(unit, str(installed.unit(unit)), 1)
    r = subprocess.run([ANALYZE, "verify", name], capture_output=True, text=True, timeout=60,
                       cwd=installed.root)
    # verify exits 0 on unknown or misspelt settings and only warns: any
    # output is a finding.
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stderr


@needs_analyze
@pytest.mark.parametrize("unit", list(UNITS))
def test_unit_hardening_exposure(installed, unit):
    name, threshold = UNITS[unit]
    name = name.replace(unit, str(installed.unit(unit)), 1)
    r = subprocess.run([ANALYZE, "security", "--offline=yes", f"--threshold={threshold}", name],
                       capture_output=True, text=True, timeout=60, cwd=installed.root)
    overall = [line for line in r.stdout.splitlines() if "Overall exposure" in line]
    assert r.returncode == 0, f"exposure above {threshold / 10}: {overall}"


def test_daemon_unit_contract(installed):
    unit = installed.unit("blockcached.service")
    assert value(unit, "Type") == "notify"
    assert value(unit, "NotifyAccess") == "main"
    assert value(unit, "WatchdogSec")
    assert value(unit, "Restart") == "on-failure"
    assert value(unit, "RuntimeDirectory") == "blockcache"
    assert value(unit, "ProtectSystem") == "strict"
    assert value(unit, "NoNewPrivileges") == "yes"
    assert value(unit, "CapabilityBoundingSet") == ""
    assert value(unit, "UMask") == "0022"
    # ExecStart's --config is the file make installed, and its socket dir is
    # the RuntimeDirectory.
    argv = exec_start(unit)
    cfg_path = argv[argv.index("--config") + 1]
    cfg = tomllib.loads((installed.root / cfg_path.lstrip("/")).read_text())
    assert os.path.dirname(cfg["socket"]) == "/run/" + value(unit, "RuntimeDirectory")
    # Every cache dir of the installed config is writable under ProtectSystem=strict.
    writable = " ".join(values(unit, "ReadWritePaths")).split()
    for d in cfg["cache_dirs"]:
        assert d["path"] in writable, f"{d['path']} is read-only for the daemon"


def test_fsclient_unit_mounts_in_the_host_namespace(installed):
    unit = installed.unit("fsclient@.service")
    used = {k for s, k, _ in parse_unit(unit) if s == "Service"}
    assert not used & MOUNT_NAMESPACE_SETTINGS, (
        f"{sorted(used & MOUNT_NAMESPACE_SETTINGS)} would hide the FUSE mount in a private "
        f"mount namespace")
    assert value(unit, "CapabilityBoundingSet") == "CAP_SYS_ADMIN"
    assert "/dev/fuse rw" in values(unit, "DeviceAllow")
    # the keeper (a child of ExecStart) keeps a worker's worth of /dev/fuse
    # descriptors and the saved state in the unit's fd store
    assert value(unit, "NotifyAccess") == "all"
    assert int(value(unit, "FileDescriptorStoreMax")) >= 33
    # a restart leaves the mount in the store, a stop unmounts
    # (tests/fsclient/keeper/test_fdstore.py)
    assert value(unit, "RestartKillSignal") == handoff.RESTART_SIGNAL.name
    assert value(unit, "KillSignal") == "SIGTERM"
    assert "blockcache" in value(unit, "SupplementaryGroups").split()
    argv = exec_start(unit)
    assert argv[argv.index("--config") + 1] == "/etc/blockcache/volumes/%i.toml"
    # Readiness: without --foreground, `fsclient mount` returns once the mount answers.
    assert value(unit, "Type") == "forking" and "--foreground" not in argv
    # The daemon restarting (an upgrade) must not take the mount down.
    wants = " ".join(values(unit, "Wants", "Unit")).split()
    assert "blockcached.service" in wants
    assert "blockcached.service" in " ".join(values(unit, "After", "Unit")).split()
    for strong in ("Requires", "BindsTo", "PartOf", "Requisite"):
        assert "blockcached.service" not in " ".join(values(unit, strong, "Unit"))


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None,
                    reason="systemd-sysusers is not installed")
def test_sysusers_entry_creates_the_daemon_user(installed, tmp_path):
    (tmp_path / "etc").mkdir()
    subprocess.run(["systemd-sysusers", f"--root={tmp_path}",
                    str(installed.root / "etc/sysusers.d/blockcache.conf")],
                   check=True, capture_output=True, timeout=60)
    users = {line.split(":")[0]: line.split(":")
             for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0] for line in (tmp_path / "etc/group").read_text().splitlines()}
    unit = installed.unit("blockcached.service")
    assert value(unit, "User") in users and value(unit, "Group") in groups
    assert users["blockcache"][5] == "/var/cache/blockcache"
    assert users["blockcache"][6] == "/usr/sbin/nologin"
