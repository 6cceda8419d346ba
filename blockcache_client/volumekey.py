"""Volume key files: 32 random bytes, stored as 64 hex digits and a newline.

A key file must not be readable or writable by group or others (mode 0400 or
0600): a key readable by every pod would let any pod read every volume's
cached blocks. Kubernetes Secrets mounted with `defaultMode: 0400` satisfy it.
It must be owned by the user reading it or by root (whoever owns it can
change it). Raw 32-byte files are accepted too (a Secret holding the bytes as
they are), if they look random: 32 ASCII characters are a passphrase, and a
passphrase is not a key. The file is opened without blocking, so a FIFO at
the path is refused instead of hanging the reader.
"""

from __future__ import annotations

import os
import re
import secrets
import stat

from .contract.blockfile import KEY_SIZE
from .contract.errors import ConfigError


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
    fd = _open(path)
    try:
        return load_key_fd(fd, path)
    finally:
        os.close(fd)


def load_key(key: str | int) -> bytes:
    """The volume key from a key file's path, or from an open descriptor of it
    (read at offset 0 and left open: for a process that may not open the file
    itself, as fsclient's servers, whose keeper opened it)."""
    return load_key_fd(key, f"key descriptor {key}") if isinstance(key, int) \
        else load_key_file(key)


def open_key_file(path: str, owners: tuple[int, ...] = ()) -> int:
    """An open descriptor (close-on-exec) of a checked volume key file, for a
    process that hands the key on without letting the other open the path (a
    keeper to its unprivileged servers, whose uids are `owners`: they may own
    it too). ConfigError as `load_key_file`."""
    fd = _open(path)
    try:
        load_key_fd(fd, path, owners)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open(path: str) -> int:
    try:
        # O_NONBLOCK: a FIFO (or a device) at the path must not hang the
        # caller in open(2); it is refused as not a regular file
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"key file {path} does not exist; create one with "
                          f"`fsclient keygen {path}`") from None
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror}") from None


def load_key_fd(fd: int, what: str, owners: tuple[int, ...] = ()) -> bytes:
    """Read and check the volume key open on `fd` (from offset 0, leaving the
    descriptor's offset alone, so it can be read again); `what` names it in
    errors; `owners`: uids that may own it besides this process's and root."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise ConfigError(f"key descriptor {what}: {exc.strerror}; pass an open descriptor "
                          f"of the key file") from None
    _check_file(what, st, owners)
    return _parse_key(what, _pread_some(fd, 4 * KEY_SIZE + 1))


def _check_file(path: str, st: os.stat_result, owners: tuple[int, ...] = ()) -> None:
    """A regular file, owned by the reader or root (or `owners`), that no one
    else may read or write."""
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"key file {path} is not a regular file; point key_file at the "
                          f"file `fsclient keygen` wrote")
    me = os.geteuid()
    if st.st_uid not in (me, 0, *owners):
        # whoever owns the file could change it, or read it back
        raise ConfigError(f"key file {path} is owned by uid {st.st_uid}; it must belong to "
                          f"the user reading it (uid {me}) or root: run "
                          f"`chown {me} {path}`")
    if st.st_mode & 0o077:
        raise ConfigError(f"key file {path} has mode {stat.S_IMODE(st.st_mode):04o}, "
                          f"readable or writable by group/others; run "
                          f"`chmod 0400 {path}`")


def _pread_some(fd: int, n: int) -> bytes:
    """Up to `n` bytes from offset 0 (a short key file may come in more than one read)."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        chunk = os.pread(fd, n - got, got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


_HEX_KEY = re.compile(rb"[0-9a-fA-F]{%d}" % (2 * KEY_SIZE))
# 32 random bytes have ~30 distinct values and a byte >= 0x80 but with
# probability 2**-32; fewer distinct values, or ASCII only, is a passphrase,
# text or a pattern, never a key made by a random generator
_MIN_DISTINCT = 16


def _parse_key(path: str, data: bytes) -> bytes:
    text = data.strip()
    if _HEX_KEY.fullmatch(text):
        key = bytes.fromhex(text.decode("ascii"))
        why = "its 64 hex digits"
    elif len(data) == KEY_SIZE:
        key = data
        why = f"its {KEY_SIZE} raw bytes"
        if max(key) < 0x80:
            raise ConfigError(f"key file {path} holds {KEY_SIZE} ASCII characters (a "
                              f"passphrase or text?), not {KEY_SIZE} random bytes; a volume "
                              f"key must be random: create one with `fsclient keygen FILE`")
    else:
        raise ConfigError(f"key file {path} does not hold a volume key: expected exactly "
                          f"{2 * KEY_SIZE} hex digits with no spaces inside (or {KEY_SIZE} "
                          f"random raw bytes); create one with `fsclient keygen FILE`")
    if len(set(key)) < _MIN_DISTINCT:
        raise ConfigError(f"key file {path}: {why} have only {len(set(key))} distinct byte "
                          f"values, a pattern rather than a random key; create one with "
                          f"`fsclient keygen FILE`")
    return key
