"""Where a volume's staged files live on the node, and the bound on them.

A staged file is made with O_TMPFILE in the staging directory: it has no
name, so no other process can open it (and no other uid could read it:
mode 0600, and it holds only ciphertext), and when its process ends, killed
or not, the kernel frees it: nothing is left to clean up. A filesystem
without O_TMPFILE gets a named file (O_EXCL, 0600) unlinked at once.

`StagingArea` counts the bytes staged files hold on disk, for one volume
in one process (a mount's server: the bound is per mount). Past `limit` a
write gets ENOSPC, with a message naming the setting that raises it.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading

from ..contract.errors import ConfigError

DEFAULT_DIR = "/var/tmp"           # disk, not tmpfs: staged files can be large
DEFAULT_LIMIT = 16 << 30


def default_dir() -> str:
    """$BLOCKCACHE_STAGING_DIR, else /var/tmp."""
    return os.environ.get("BLOCKCACHE_STAGING_DIR") or DEFAULT_DIR


class StagingArea:
    """One volume's staged files in this process: their directory and bound."""

    def __init__(self, directory: str, limit: int, volume: str,
                 setting: str = "staging_bytes"):
        self.directory = directory
        self.limit = int(limit)
        self.volume = volume
        self.setting = setting  # what a user raises, as the ENOSPC message names it
        self.used = 0
        self._lock = threading.Lock()
        if self.limit <= 0:
            raise ConfigError(f"volume {volume}: {setting} must be a positive number of "
                              f"bytes, not {limit!r}")
        try:
            st = os.stat(directory)
        except OSError as exc:
            raise ConfigError(f"volume {volume}: staging directory {directory}: "
                              f"{exc.strerror}; create it or set staging_dir") from None
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"volume {volume}: staging directory {directory} is not a "
                              f"directory; set staging_dir to one")

    def new_file(self) -> int:
        """A descriptor of a new, nameless, empty file in the staging directory."""
        try:
            return os.open(self.directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise OSError(exc.errno, f"staging directory {self.directory}: "
                                         f"{exc.strerror}") from None
        fd, path = tempfile.mkstemp(prefix=".blockcache-staged-", dir=self.directory)
        os.unlink(path)
        return fd

    def reserve(self, n: int, rel: str) -> None:
        """Count `n` more staged bytes, or OSError(ENOSPC) past the limit."""
        with self._lock:
            if self.used + n > self.limit:
                raise OSError(errno.ENOSPC, f"write {rel}: the staging area of volume "
                                            f"{self.volume} is full ({self.used} of "
                                            f"{self.limit} bytes staged in "
                                            f"{self.directory}); raise {self.setting}, or "
                                            f"close or fsync files sooner")
            self.used += n

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n
