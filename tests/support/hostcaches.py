"""The host's dentry, inode and page caches are one for every test at once:
a test that drops them (`/proc/sys/vm/drop_caches`) makes the kernel forget
the nodes and pages of every other test's mounts too. Such a test, and a
test whose assertions count on the kernel keeping what it cached (no LOOKUP
in a warm epoch), take turns on one lock, whichever pytest worker runs them.
The lock is in pytest's own temporary tree (root's, 0700: no other uid can
plant a file or a link where root opens it), shared by a run's workers:
`tmp_path_factory.getbasetemp().parent`.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = "host-caches.lock"


@contextmanager
def host_caches(tmp_path_factory) -> Iterator[None]:
    """Hold the host's caches: no other test of this run drops them meanwhile."""
    lock = Path(tmp_path_factory.getbasetemp()).parent / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (the lock goes with it)
