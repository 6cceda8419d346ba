"""systemd notifications (READY, WATCHDOG, STOPPING) without a dependency.

Speaks the sd_notify datagram protocol directly: one datagram to the unix
socket named by $NOTIFY_SOCKET ('@' = abstract namespace). Does nothing when
not started by systemd. The watchdog ping is sent from the event loop, so a
wedged loop stops the pings and systemd restarts the daemon.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        self.address = addr or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_interval: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 2e6  # ping at half the timeout

    def notify(self, state: str) -> bool:
        """Send one state string; False (logged) if it could not be sent."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                # Never block: this runs on the event loop, and a notify socket
                # nobody reads fills after a few datagrams; a lost ping is better
                # than a daemon stalled for every client.
                s.sendto(state.encode(), socket.MSG_DONTWAIT, self.address)
            return True
        except OSError as exc:
            log.warning("cannot notify systemd at %r: %s", self.address, exc)
            return False

    def ready(self, status: str = "") -> None:
        self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def stopping(self) -> None:
        self.notify("STOPPING=1")
