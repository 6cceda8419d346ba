"""Volume key files: 32 random bytes, stored as 64 hex digits and a newline.

A key file must not be readable or writable by group or others (mode 0400 or
0600): a key readable by every pod would let any pod read every volume's
cached blocks. Kubernetes Secrets mounted with `defaultMode: 0400` satisfy it.
Raw 32-byte files are accepted too (a Secret holding the bytes as they are).
"""

from __future__ import annotations

import os
import secrets
import stat

from .blockfile import KEY_SIZE
from .errors import ConfigError


def generate_key_file(path: str) -> None:
    """Write a new random volume key to `path` (mode 0400); never overwrites."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    except FileExistsError:
        raise ConfigError(f"key file {path} already exists; remove it first if you "
                          f"really mean to replace the key (its cached blocks become "
                          f"unreadable)") from None
    except OSError as exc:
        raise ConfigError(f"cannot create key file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_SIZE) + "\n")
        f.flush()
        os.fsync(f.fileno())


def load_key_file(path: str) -> bytes:
    """Read and check a volume key file. ConfigError says what is wrong and how to fix it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ConfigError(f"key file {path} does not exist; create one with "
                          f"`fsclient keygen {path}`") from None
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # checked before fdopen, which refuses dirs itself
        os.close(fd)
        raise ConfigError(f"key file {path} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_mode & 0o077:
            raise ConfigError(f"key file {path} has mode {stat.S_IMODE(st.st_mode):04o}, "
                              f"readable or writable by group/others; run "
                              f"`chmod 0400 {path}`")
        data = f.read(4 * KEY_SIZE)
    text = data.strip()
    if len(data) == KEY_SIZE:
        return data
    if len(text) == 2 * KEY_SIZE:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise ConfigError(f"key file {path} does not hold a volume key: expected "
                      f"{2 * KEY_SIZE} hex digits (or {KEY_SIZE} raw bytes); create one "
                      f"with `fsclient keygen FILE`")
