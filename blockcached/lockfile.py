"""Exclusive flock-based locks, so two daemons never share a cache dir or socket.

The lock is held for the life of the process by keeping the fd open; the
kernel drops it when the process dies, however it dies, so there is never a
stale lock to clean up. The holder's pid is written into the file only to make
the error message useful.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from blockcache_client.contract.errors import ConfigError


class LockHeld(ConfigError):
    """Another process holds the lock."""


def acquire(path: str, what: str) -> int:
    """Take an exclusive lock on `path` (created 0644); returns the fd to keep open.
    Never through a symlink, nor on anything but a regular file: the daemon
    writes its pid into it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                     0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"lock file {path} is a symlink; remove it (blockcached "
                              f"creates its own)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"lock file {path} is not a regular file; remove it (blockcached "
                          f"creates its own)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = ""
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        except OSError:
            pass
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise LockHeld(f"{what} is in use by another blockcached "
                           f"(lock {path} held{' by pid ' + holder if holder else ''}); "
                           f"stop it or choose another {what.split()[0]}") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
