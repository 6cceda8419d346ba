"""Run the real daemon the way blockcached.service runs it (see unit_runner).

As the unit's user with no capabilities, under the unit's UMask=, it must
send READY=1 from the main pid once the socket serves, ping the watchdog,
and send STOPPING=1 and exit 0 on SIGTERM; the socket must admit its group
and nobody else, also through a read-only mount of its dir (as pods mount
it), and the block files it writes must be readable by any pod.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.support.deploy import unit_runner
from tests.support.deploy.package_install import bin_dir
from tests.support.deploy.unit_runner import SERVICE_GID, WAIT, DaemonService, put_block, setpriv
from tests.support.deploy.units import install

pytest.importorskip("blockcached", reason="the daemon package blockcached is not installed")
pytestmark = [
    pytest.mark.skipif(unit_runner.available() is not None, reason=str(unit_runner.available())),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)"),
]

OTHER_UID = 4242      # a user or pod that is not in the socket's group


def cli(uid: int, groups: list[int], socket_path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(setpriv(uid, uid, groups, [str(bin_dir() / "blockcache-cli"), *args]),
                          env={"PATH": os.environ["PATH"], "BLOCKCACHE_SOCKET": socket_path},
                          capture_output=True, text=True, timeout=WAIT)


def test_daemon_started_like_the_unit_notifies_serves_and_stops():
    with unit_runner.scratch_root() as root:
        daemon = unit_runner.start_daemon(install(root / "dest"), root)
        try:
            check_daemon(daemon)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- daemon log ---\n{daemon.log()}") from None
        finally:
            daemon.stop()


def check_daemon(d: DaemonService) -> None:
    # NotifyAccess=main: systemd only listens to the main pid.
    assert d.notify.wait_for("READY") == [d.proc.pid], "READY=1 must come from the main process"
    # READY=1 means the socket serves: a peer in the socket's group (how
    # fsclient@.service connects, as root without CAP_DAC_OVERRIDE) gets an
    # answer, and a peer outside it is refused by the socket's mode.
    st = os.stat(d.socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == SERVICE_GID
    ok = cli(OTHER_UID, [SERVICE_GID], d.socket_path, "ping")
    assert ok.returncode == 0, ok.stderr
    refused = cli(OTHER_UID, [], d.socket_path, "ping")
    assert refused.returncode != 0 and refused.stderr.strip()
    # Pods mount the socket dir read-only (readOnly hostPath = a read-only
    # bind mount): connecting to a socket needs no write access to its file
    # system, while nothing can be created there.
    ro = ping_through_read_only_bind(d.run_dir)
    assert ro.returncode == 0, ro.stdout + ro.stderr
    assert "Read-only file system" in ro.stderr
    # Blocks written under the unit's umask are readable by every pod (pods
    # mount the cache dir read-only and open block files themselves).
    path = Path(put_block(d.socket_path))
    for p in (path, *path.parents):
        if p == d.cache_dir:
            break
        assert stat.S_IMODE(p.stat().st_mode) == (0o644 if p == path else 0o711), p
    reader = subprocess.run(setpriv(OTHER_UID, OTHER_UID, [], ["cat", str(path)]),
                            capture_output=True, timeout=WAIT)
    assert reader.returncode == 0 and reader.stdout, reader.stderr
    # The event loop pings the watchdog every WATCHDOG_USEC/2.
    assert set(d.notify.wait_for("WATCHDOG", count=3)) == {d.proc.pid}
    d.proc.send_signal(signal.SIGTERM)
    d.notify.wait_for("STOPPING")
    assert d.proc.wait(timeout=WAIT) == 0
    assert not os.path.exists(d.socket_path)
    assert d.run_dir.is_dir(), "the daemon must leave its RuntimeDirectory in place"


def ping_through_read_only_bind(run_dir) -> subprocess.CompletedProcess:
    """`blockcache-cli ping` via a read-only bind mount of the socket dir, in a
    private mount namespace (as a pod's readOnly hostPath mount sees it)."""
    script = ('mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && '
              '! touch "$2/planted" && BLOCKCACHE_SOCKET="$2/blockcached.sock" "$3" ping')
    with tempfile.TemporaryDirectory() as mnt:
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               script, "sh", str(run_dir), mnt, str(bin_dir() / "blockcache-cli")],
                              capture_output=True, text=True, timeout=WAIT)


