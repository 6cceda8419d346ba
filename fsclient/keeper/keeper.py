"""The keeper: a small process that holds a mount's FUSE connection and its saved
state, and runs the server that answers it, so that the mount outlives the server.

It mounts when its first server asks (after that server has opened its volume),
then holds the mount's /dev/fuse descriptor, one clone of it per further worker,
and the saved-state memfd (`saved`). It does no file I/O of its own: it only
starts servers, hands them the descriptors (`handoff`), and waits.

- A server that dies (a crash, kill -9, OOM) is started again at once, then with
  a backoff of up to MAX_BACKOFF while restarts fail before serving. The kernel
  keeps the requests the dead server had read on the keeper's descriptors; the
  new one asks for them again (FUSE_NOTIFY_RESEND).
- A server that exits 0 has ended the mount (unmounted, SIGTERM): the keeper
  exits 0 too. The first server failing before it serves ends the keeper with
  its code, and the keeper unmounts what it mounted.
- `restart` (its control socket, `control`; who may ask: `desk`): a new
  server opens its volume while the old one serves on; then the old one is
  told to hand over (stop taking requests, finish its own, exit), and the new
  one gets the connection.
- SIGTERM/SIGINT end the mount: the server unmounts. Under systemd with the
  connection in its fd store (`fdstore`), a unit's restart sends RESTART_SIGNAL
  (RestartKillSignal=): the server hands over, the store keeps the connection,
  and the next start takes the mount over from LISTEN_FDS (`adopt`). A stored
  server ignores systemd's signals, which are its keeper's to act on.
- `surrender` (asked by the plugin that replaces this keeper's, say): the
  asker gets the connection (`handoff.send`), passes it to a new keeper it
  starts (`adopt`, with this control connection as `predecessor`); that keeper
  acks once its server has its volume open, then this one hands its server
  over as on a stop under systemd and exits, leaving the mount; the new keeper
  connects its server when this control connection ends. Before the ack, the
  asker going away changes nothing: this keeper serves on.
- If the keeper dies, its server starts the next keeper and hands over to it
  (`successor`); failing that, it ends the connection (ENOTCONN), and the next
  `fsclient mount` there recovers the mount point.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ..session import mount as fusemount
from ..session.channel import Channel
from . import handoff, saved
from .desk import ControlDesk
from .fdstore import FdStore
from .privileges import Credentials, drop

log = logging.getLogger(__name__)

MAX_BACKOFF = 5.0
HANDOVER_TIMEOUT = 30.0  # the old server's time to finish its requests


class Server:
    """One server process and the keeper's end of its socket."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket):
        self.proc = proc
        self.sock = sock
        self.serving = False
        self.connected = False


class Keeper(ControlDesk):
    """Holds one mount's connection and keeps a server on it (its control
    socket's requests: `desk`)."""

    def __init__(self, mountpoint: str, options: list[str], channels: int,
                 command: Callable[[int, int | None], list[str]],
                 store: FdStore | None = None, run_as: Credentials | None = None,
                 key_fd: int = -1):
        self.mountpoint = mountpoint
        self.options = options
        self.channels = max(1, channels)
        # the server's argv, given the fd of its socket and the readiness fd
        self.command = command
        self.fds: list[int] = []  # the mount's descriptor, then its clones
        self.saved_fd = -1
        self.run_as = run_as  # the server's uid and groups, capabilities dropped
        # the volume key, which each server asks for once it is not dumpable ("key")
        self.key_fd = key_fd
        self.restarts = 0
        self.server: Server | None = None
        self.successor: Server | None = None  # a restart's new server, until it takes over
        # while the old server hands over to the successor: when it is killed instead
        self.handover_until: float | None = None
        self.waiters: list[socket.socket] = []  # `restart` callers waiting for the successor
        self.terminate = False
        self.served = False  # a server has served this mount: restart, never give up
        self.control: socket.socket | None = None
        self.store = store  # systemd's fd store, which keeps the connection across starts
        self.keeping = False  # ending, but the mount stays: in the store, or surrendered
        self.in_store = False  # systemd's fd store holds the connection
        self.ready_sent = False
        self.predecessor: socket.socket | None = None  # the surrendering keeper's connection
        self.pending: Server | None = None  # our server, waiting for the predecessor to go
        self.acked = False
        self.asker: socket.socket | None = None  # `surrender`'s asker, until its ack
        self.left_to: socket.socket | None = None  # held until exit: its end tells the taker

    def adopt(self, fuse_fds: list[int], saved_fd: int, predecessor: int = -1) -> None:
        """Take over a live connection that systemd kept (the unit restarted), or
        that the keeper at the other end of `predecessor` surrendered."""
        self.fds, self.saved_fd = fuse_fds, saved_fd
        self.served = True  # a server served it: restart servers, never unmount
        self.in_store = predecessor < 0 and self.store is not None  # (from LISTEN_FDS)
        if predecessor >= 0:
            self.predecessor = socket.socket(fileno=predecessor)

    # descriptors

    def _mount(self) -> None:
        fd = fusemount.mount(self.mountpoint, self.options)
        self.fds = [fd]
        for _ in range(self.channels - 1):
            try:
                self.fds.append(Channel.clone(fd, 0).fd)
            except OSError as exc:  # an old kernel: the workers share the one descriptor
                log.warning("cannot clone the FUSE channel (%s); workers share one", exc)
                break
        self.saved_fd = saved.create()
        if self.store is not None:
            try:
                self.store.store(self.fds, self.saved_fd)
                self.in_store = True
            except OSError as exc:
                log.warning("cannot keep the FUSE connection in systemd's fd store (%s): "
                            "a restart of the unit will remount", exc)

    def _open_root(self) -> list[int]:
        """[an O_PATH descriptor of the mount's root], for the server's readiness
        probe: it needs no search permission on the mount point's parents (a
        server `run_as` another uid may have none). Opening it asks nothing of
        the FUSE server; it is held only until handed over, as it keeps the
        mount busy."""
        try:
            return [os.open(self.mountpoint, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]
        except OSError as exc:
            log.warning("cannot open the root of %s (%s); the server probes it by path",
                        self.mountpoint, exc)
            return []

    def close(self) -> None:
        for fd in [*self.fds, self.saved_fd, self.key_fd]:
            if fd >= 0:
                os.close(fd)
        self.fds, self.saved_fd, self.key_fd = [], -1, -1
        for sock in (self.control, self.predecessor, self.asker, self.left_to):
            if sock is not None:
                sock.close()

    # servers

    def _spawn(self, ready_fd: int | None = None) -> Server:
        ours, theirs = handoff.pair()
        extra = (ready_fd,) if ready_fd is not None else ()
        unprivileged = {} if self.run_as is None else \
            {"preexec_fn": partial(drop, self.run_as), "cwd": "/"}
        try:
            proc = subprocess.Popen(self.command(theirs.fileno(), ready_fd),
                                    stdin=subprocess.DEVNULL,
                                    pass_fds=(theirs.fileno(), *extra), close_fds=True,
                                    **unprivileged)
        finally:
            theirs.close()
        log.info("keeper %d: started server %d on %s", os.getpid(), proc.pid, self.mountpoint)
        return Server(proc, ours)

    def _connect(self, server: Server) -> None:
        """Hand `server` the connection (mounting it first, for the first server)."""
        fresh = not self.fds
        if fresh:
            try:
                self._mount()
            except (OSError, ValueError) as exc:
                handoff.send(server.sock, {"error": str(exc)})
                return
        root = self._open_root()
        try:
            handoff.send(server.sock, {"fresh": fresh, "restarts": self.restarts,
                                       "keeper": os.getpid(), "stored": self.in_store,
                                       "root": bool(root)},
                         [self.saved_fd, *root, *self.fds])
        finally:
            for fd in root:
                os.close(fd)
        server.connected = True

    def _on_message(self, server: Server) -> None:
        message, fds = handoff.receive(server.sock)
        for fd in fds:
            os.close(fd)
        if message is None:
            return
        op = message.get("op")
        if op == "key":  # (asked once the server is not dumpable: `mountkey`)
            if self.key_fd >= 0:
                handoff.send(server.sock, {"key": True}, [self.key_fd])
            else:
                handoff.send(server.sock, {"error": "this keeper holds no volume key"})
        elif op == "connect":
            if server is self.successor:
                self._hand_over()
            elif self.keeping:  # surrendered: the connection is the new keeper's now
                server.proc.kill()
            elif self.predecessor is not None:
                self._await_predecessor(server)
            else:
                self._connect(server)
        elif op == "serving":
            server.serving = True
            if self.store is not None and not self.ready_sent:
                self.ready_sent = True
                self._notify("READY=1")
            self.served = True
            if server is self.server:
                for w in self.waiters:
                    handoff.send(w, {"ok": True, **self.status()})
                    w.close()
                self.waiters = []

    def _await_predecessor(self, server: Server) -> None:
        """Our server has its volume open: ack, and connect it once the keeper
        that surrendered the connection (and so its server) has gone."""
        self.pending = server
        if not self.acked:
            self.acked = True
            try:
                handoff.send(self.predecessor, {"op": "ack"})  # type: ignore[arg-type]
            except OSError:
                pass  # it is gone already: its end shows at once

    def _on_predecessor(self) -> None:
        assert self.predecessor is not None
        message, fds = handoff.receive(self.predecessor)
        for fd in fds:
            os.close(fd)
        if message is not None:
            return
        log.info("keeper %d: the keeper before has left %s; taking it over", os.getpid(),
                 self.mountpoint)
        self.predecessor.close()
        self.predecessor, pending, self.pending = None, self.pending, None
        if pending is not None and pending is self.server and pending.proc.poll() is None:
            self._connect(pending)

    def _hand_over(self) -> None:
        """The successor has its volume open: tell the old server to hand over.
        The loop connects the successor once the old one has gone
        (`_await_hand_over`), answering control requests meanwhile."""
        old, new = self.server, self.successor
        assert new is not None
        if old is None or old.proc.poll() is not None:
            self._handed_over()
            return
        log.info("keeper %d: server %d has its volume open; server %d hands over",
                 os.getpid(), new.proc.pid, old.proc.pid)
        handoff.send(old.sock, {"op": "handover"})
        self.handover_until = time.monotonic() + HANDOVER_TIMEOUT

    def _await_hand_over(self, until: float) -> None:
        """Connect the successor once the old server has exited, or kill the old
        one at `until` (HANDOVER_TIMEOUT after it was told)."""
        old = self.server
        assert old is not None
        if old.proc.poll() is None and time.monotonic() >= until:
            log.warning("server %d did not hand over within %gs; killed", old.proc.pid,
                        HANDOVER_TIMEOUT)
            old.proc.kill()
            old.proc.wait()
        if old.proc.poll() is not None:
            self._handed_over()

    def _handed_over(self) -> None:
        old, new = self.server, self.successor
        assert new is not None
        if old is not None:
            old.sock.close()
        self.server, self.successor, self.handover_until = new, None, None
        self.restarts += 1
        self._connect(new)

    # the loop

    def run(self, ready_fd: int | None, control: socket.socket | None) -> int:
        """Keep a server on the mount until it ends; the exit code."""
        self.control = control
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT, handoff.RESTART_SIGNAL)}
        try:
            self.server = self._spawn(ready_fd)
            if ready_fd is not None:
                os.close(ready_fd)  # the server reports readiness; our copy would hide its EOF
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()

    def _notify(self, state: str) -> None:
        try:
            self.store.notify(state)  # type: ignore[union-attr]
        except OSError as exc:
            log.warning("cannot notify systemd (%s): %s", state.replace("\n", " "), exc)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.terminate = True
        # a restart of the unit: the store keeps the mount for the next start
        self.keeping = signum == handoff.RESTART_SIGNAL and self.in_store
        log.info("keeper %d: %s: %s", os.getpid(), signal.Signals(signum).name,
                 "keeping the mount in the store" if self.keeping else "unmounting")
        for s in (self.server, self.successor):
            if s is None or s.proc.poll() is not None:
                continue
            if self.keeping:
                handoff.send(s.sock, {"op": "handover"})
            elif self.in_store and s.connected:  # (it ignores signals: `Connection.stored`)
                handoff.send(s.sock, {"op": "unmount"})
            else:
                s.proc.send_signal(signal.SIGTERM)

    def _loop(self) -> int:
        backoff = 0.0
        while True:
            socks: dict[Any, Any] = {s.sock: s for s in (self.server, self.successor)
                                     if s is not None}
            for sock, handler in ((self.control, self._on_control),
                                  (self.predecessor, self._on_predecessor),
                                  (self.asker, self._on_asker)):
                if sock is not None:
                    socks[sock] = handler
            ready, _, _ = select.select(list(socks), [], [], 0.1)
            for sock in ready:
                target = socks[sock]
                if isinstance(target, Server):
                    self._on_message(target)
                else:
                    target()
            if self.successor is not None and self.successor.proc.poll() is not None:
                log.warning("the new server %d exited with %s before taking over; %s",
                            self.successor.proc.pid, self.successor.proc.returncode,
                            "the old one, told to hand over, is replaced once it has"
                            if self.handover_until is not None else "the old one serves on")
                self.successor.sock.close()
                self.successor, self.handover_until = None, None
                for w in self.waiters:
                    handoff.send(w, {"error": "the new server exited before taking over; "
                                              "see the mount's log"})
                    w.close()
                self.waiters = []
            if self.handover_until is not None:  # (the old server's exit is no death)
                self._await_hand_over(self.handover_until)
                continue
            server = self.server
            assert server is not None
            code = server.proc.poll()
            if code is None:
                if server.serving:
                    backoff = 0.0
                continue
            server.sock.close()
            if code == 0 or self.terminate or not self.served:
                return self._end(code)
            # (a server that handed over unasked, SIGTERMed under systemd, is replaced too)
            log.warning("server %d died (%s); starting another on %s", server.proc.pid,
                        _describe(code), self.mountpoint)
            time.sleep(backoff)
            backoff = min(MAX_BACKOFF, max(0.5, backoff * 2)) if not server.serving else 0.0
            self.restarts += 1
            self.server = self._spawn()

    def _end(self, code: int) -> int:
        """The server is gone for good: unmount if it could not (it never served,
        or died under SIGTERM), and end: 0 if the mount ended as asked."""
        if self.keeping or code == handoff.HANDED_OVER:
            log.info("keeper %d: %s stays mounted, kept by systemd or the keeper it was "
                     "surrendered to", os.getpid(), self.mountpoint)
            return 0
        if self.fds and code != 0:
            try:
                fusemount.unmount_lazy(self.mountpoint)
            except OSError as exc:
                log.warning("%s", exc)
        if self.store is not None and self.fds:
            self._notify("FDSTOREREMOVE=1\nFDNAME=fuse")
            self._notify("FDSTOREREMOVE=1\nFDNAME=saved")
        if code == 0 or (self.terminate and self.served):
            return 0
        return code if code > 0 else 1

def _describe(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
