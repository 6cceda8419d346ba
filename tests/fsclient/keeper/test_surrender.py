"""`surrender`: a keeper hands its live connection to whoever asks (the CSI
plugin that replaces another), who starts a new `fsclient mount --foreground`
with it (LISTEN_FDS, `fdstore.hand_on`). A reader in its own process verifies
every byte while the mount changes hands and the old keeper's process group
is killed; an asker that dies before its ack leaves the old keeper serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import suppress

import pytest

from fsclient import keeper as keeping
from tests.fsclient.conftest import BLOCK
from tests.support.fsclient_mounts import REPO, FsclientMount, env
from tests.support.keepers import Reader, serving, surrender_to

pytestmark = pytest.mark.fuse

WAIT = 60.0


def _keeper(tree, key_file, daemon, mountpoint, log_path) -> FsclientMount:
    return FsclientMount(tree, mountpoint, key_file, daemon.socket_path,
                         args=["--block-size", str(BLOCK), "--meta-ttl", "0"],
                         log_path=str(log_path), own_session=True)


def _kill_group(m: FsclientMount) -> None:
    if m.proc is not None:
        with suppress(ProcessLookupError):
            os.killpg(m.proc.pid, signal.SIGKILL)


def test_surrender_hands_a_live_mount_to_a_new_keeper(tree, key_file, daemon, tmp_path):
    mp = str(tmp_path / "mnt")
    old = _keeper(tree, key_file, daemon, mp, tmp_path / "old.log")
    new = _keeper(tree, key_file, daemon, mp, tmp_path / "new.log")
    reader = None
    try:
        old.start()
        reader = Reader(mp, tree, tmp_path)
        time.sleep(1.0)  # the reader is under way: files open, cwd in the mount
        old_server = serving(mp)
        assert surrender_to(mp, new, WAIT)["keeper"] == old.proc.pid
        assert "stays mounted" in old.log()  # its server handed over, the keeper left
        # as a container runtime would: the old keeper's whole group, kill -9
        _kill_group(old)
        old.proc.wait(WAIT)
        assert keeping.status(mp)["keeper"] == new.proc.pid
        assert serving(mp) != old_server
        time.sleep(1.0)
        tally = reader.finish()
        assert tally["failed"] == {} and tally["wrong"] == 0, tally
        assert tally["ok"] > 50, tally
        assert "surrendered" in old.log() and "taking over" in new.log()
        assert "requests resent" in new.log() or "no resend" in new.log()
    finally:
        if reader is not None:
            reader.kill()
        for m in (new, old):
            m.stop()
            _kill_group(m)


def test_an_asker_that_dies_before_its_ack_leaves_the_keeper_serving(tree, key_file, daemon,
                                                                     tmp_path):
    mp = str(tmp_path / "mnt")
    old = _keeper(tree, key_file, daemon, mp, tmp_path / "old.log")
    reader = asker = None
    try:
        old.start()
        reader = Reader(mp, tree, tmp_path)
        time.sleep(1.0)
        server = serving(mp)
        # an asker that takes the connection, then is killed before any ack
        asker = subprocess.Popen(
            [sys.executable, "-c", "import sys, time\n"
             "from fsclient.keeper import control\n"
             "control.surrender(sys.argv[1], 60)\nprint('held', flush=True)\n"
             "time.sleep(60)\n", mp],
            stdout=subprocess.PIPE, env=env(), cwd=REPO)
        assert asker.stdout.readline().strip() == b"held"
        asker.kill()
        asker.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while True:  # its control socket comes back
            try:
                status = keeping.status(mp)
                break
            except keeping.MountError:
                assert time.monotonic() < deadline, old.log()
                time.sleep(0.05)
        assert status["keeper"] == old.proc.pid and status["server"] == server
        time.sleep(1.0)
        tally = reader.finish()
        assert tally["failed"] == {} and tally["wrong"] == 0, tally
        assert "left before its ack" in old.log()
        assert old.proc.poll() is None and serving(mp) == server
    finally:
        if reader is not None:
            reader.kill()
        if asker is not None and asker.poll() is None:
            asker.kill()
            asker.wait(10)
        old.stop()
        _kill_group(old)
