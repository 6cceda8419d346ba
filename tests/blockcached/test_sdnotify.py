"""The systemd notifier never blocks the daemon's event loop."""

import socket

from blockcached.sdnotify import Notifier


def test_notify_to_an_unread_socket_never_blocks(tmp_path):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)  # bound, never read: its queue fills after a few datagrams
        n = Notifier({"NOTIFY_SOCKET": path})
        sent = [n.notify("WATCHDOG=1") for _ in range(500)]
        assert sent[0] is True
        assert sent.count(False) > 0  # dropped once full, instead of waiting forever
        assert listener.recv(64) == b"WATCHDOG=1"


def test_abstract_address_and_watchdog_interval():
    n = Notifier({"NOTIFY_SOCKET": "@blockcache-test", "WATCHDOG_USEC": "4000000"})
    assert n.address == "\0blockcache-test"
    assert n.watchdog_interval == 2.0
    assert Notifier({}).notify("READY=1") is False
