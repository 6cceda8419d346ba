"""Handing a surrendered connection to a new keeper (`fdstore.hand_on`): the
named descriptors are placed at 3.. in the child, as systemd would, and a
descriptor the child also gets at its own number (its --ready-fd) is moved
out of their way first (`Passing.clear`), never overwritten. A process with
few files open (the CSI plugin's keeper host, just started) may have its
ready pipe right where the placing goes: then the new keeper wrote its
readiness to the old keeper's control connection (which died of it) and
closed that connection as its ready pipe."""

from __future__ import annotations

import subprocess
import sys

from tests.support.fsclient_mounts import REPO, env

# In a fresh interpreter, as the keeper host is: one file open, then its
# ready pipe at 4 and 5, where the saved state and the predecessor go.
PARENT = r"""
import os, socket, subprocess, sys
from fsclient.keeper.fdstore import LISTEN_FDS_START, hand_on

fuse = os.open("/dev/null", os.O_RDONLY)
r, w = os.pipe()
ours, predecessor = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
saved = os.memfd_create("saved")
passing = hand_on([("fuse", fuse), ("saved", saved), ("predecessor", predecessor.fileno())])
placed = range(LISTEN_FDS_START, LISTEN_FDS_START + 3)
print("ready pipe in the placing:", w in placed)
if sys.argv[1] == "unclear":
    try:
        passing.popen(w)
    except ValueError as exc:
        print("refused:", exc)
    sys.exit(0)
w = passing.clear(w)
print("ready pipe cleared:", w not in placed)
child = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(w)], env=passing.env,
                         **passing.popen(w))
passing.close()
os.close(w)
print("child said:", os.read(r, 100).decode())
ours.settimeout(30)
print("predecessor got:", ours.recv(100).decode())
print("child exit:", child.wait(30))
"""

# The new keeper's side: its --ready-fd and the predecessor named in LISTEN_FDNAMES.
CHILD = r"""
import os, socket, sys
names = os.environ["LISTEN_FDNAMES"].split(":")
at = {name: 3 + i for i, name in enumerate(names)}
os.write(int(sys.argv[1]), b"READY")
socket.socket(fileno=at["predecessor"]).send(b"ack")
"""


def _run(mode: str) -> str:
    res = subprocess.run([sys.executable, "-c", PARENT, mode, CHILD], capture_output=True,
                         text=True, timeout=60, env=env(), cwd=REPO)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_a_ready_pipe_where_the_connection_goes_is_moved_not_overwritten():
    out = _run("cleared")
    assert "ready pipe in the placing: True" in out, out  # (else this proves nothing)
    assert "ready pipe cleared: True" in out, out
    # on the ready pipe; the old keeper gets its ack alone, not "READY" too
    assert "child said: READY" in out, out
    assert "predecessor got: ack" in out, out
    assert "child exit: 0" in out, out


def test_a_descriptor_in_the_way_is_refused_not_overwritten():
    out = _run("unclear")
    assert "ready pipe in the placing: True" in out, out
    assert "refused: descriptors [5] would be overwritten" in out, out
