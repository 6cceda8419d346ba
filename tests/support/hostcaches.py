"""The host's dentry, inode and page caches are one for every test at once:
a test that drops them (`/proc/sys/vm/drop_caches`) makes the kernel forget
the nodes and pages of every other test's mounts too. Such a test, and a
test whose assertions count on the kernel keeping what it cached (no LOOKUP
in a warm epoch), take turns on one lock, whichever pytest worker runs them.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

LOCK = os.path.join(tempfile.gettempdir(), "blockcache-tests-host-caches.lock")


@contextmanager
def host_caches() -> Iterator[None]:
    """Hold the host's caches: no other test drops them meanwhile."""
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (the lock goes with it)
