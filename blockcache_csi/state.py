"""The plugin's state on the host (`--state-dir`): what it has published, so
that a restarted plugin finds its mounts, and their volume keys.

    STATE_DIR/            0700 root (forced at every start)
      mounts/             0700 root
        ID.json           a published target: `Publication.to_record()` + format
      keys/               0700 root
        ID.key            the volume key, 64 hex digits, 0600 root
        ID.creds          the volume's S3 credentials from its Secret, JSON, 0600 root
                          (only when it has some; a restart mounts with them again)

Only root reads a key: the keeper (root) opens it and hands its server a
descriptor, so no server uid, and no process sharing one (node-exporter's
65534), can open a key file again. ID is a hash of the target path. The key
is written before the record, and a record is written before the keeper is
started and removed after its mount is gone, so every mount the plugin made
has a record (a crash in between leaves a record without a mount, which the
next start mounts again or the kubelet's unpublish removes); a key without a
record (a crash between the two writes) is removed at start. Files are
written to a temporary name and renamed, so a record is whole or absent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator

from .environment import SourceCredentials
from .volumes import Publication

log = logging.getLogger(__name__)

FORMAT = 1


def target_id(target: str) -> str:
    return hashlib.sha256(os.fsencode(target)).hexdigest()[:32]


class StateDir:
    """Records and key files under one state dir."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.mounts = os.path.join(self.path, "mounts")
        self.keys = os.path.join(self.path, "keys")

    def prepare(self) -> None:
        """Make the dirs, root's alone (fixing owners and modes), and remove what
        a crash left: temporary files, and keys without a record."""
        for path in (self.path, self.mounts, self.keys):
            os.makedirs(path, 0o700, exist_ok=True)
            os.chown(path, 0, 0)
            os.chmod(path, 0o700)
        for d in (self.mounts, self.keys):
            for name in os.listdir(d):
                if name.endswith(".tmp"):
                    self._unlink(os.path.join(d, name))
        recorded = {n[:-len(".json")] for n in os.listdir(self.mounts) if n.endswith(".json")}
        for name in os.listdir(self.keys):
            stem, dot, kind = name.rpartition(".")
            if dot and kind in ("key", "creds") and stem not in recorded:
                log.warning("removing the %s file %s: no record names it (a publish "
                            "ended between writing it and its record)", kind, name)
                self._unlink(os.path.join(self.keys, name))

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def key_file(self, target: str) -> str:
        return os.path.join(self.keys, target_id(target) + ".key")

    def credentials_file(self, target: str) -> str:
        return os.path.join(self.keys, target_id(target) + ".creds")

    def save_credentials(self, target: str, credentials: SourceCredentials) -> None:
        """Keep `target`'s S3 credentials (root's alone), or forget old ones."""
        path = self.credentials_file(target)
        if credentials:
            self._write(path, credentials.to_json())
        else:
            self._unlink(path)

    def credentials(self, target: str) -> SourceCredentials:
        """`target`'s S3 credentials; none if it has none (or they are unreadable)."""
        try:
            with open(self.credentials_file(target), "rb") as f:
                return SourceCredentials.from_json(f.read())
        except FileNotFoundError:
            return SourceCredentials()
        except (OSError, ValueError) as exc:
            log.error("ignoring the unreadable credentials file %s (%s): the volume is "
                      "mounted again without credentials", self.credentials_file(target),
                      type(exc).__name__)
            return SourceCredentials()

    def _record_file(self, target: str) -> str:
        return os.path.join(self.mounts, target_id(target) + ".json")

    @staticmethod
    def _write(path: str, data: bytes) -> None:
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def save(self, pub: Publication, key: bytes) -> None:
        """Record `pub` and its key (the key first: a record always has one)."""
        self._write(self.key_file(pub.target), key.hex().encode() + b"\n")
        record = {"format": FORMAT, **pub.to_record()}
        self._write(self._record_file(pub.target), json.dumps(record).encode())

    def load(self, target: str) -> Publication | None:
        return self._read(self._record_file(target))

    def key(self, target: str) -> bytes | None:
        try:
            with open(self.key_file(target), "rb") as f:
                return bytes.fromhex(f.read().decode().strip())
        except (OSError, ValueError):
            return None

    def _read(self, path: str) -> Publication | None:
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, not {FORMAT}")
            return Publication.from_record(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("ignoring the unreadable state record %s (%s); unpublish its target "
                      "by hand if it is still mounted", path, exc)
            return None

    def remove(self, target: str) -> None:
        """Forget `target`: its record, then its key and credentials."""
        for path in (self._record_file(target), self.key_file(target),
                     self.credentials_file(target)):
            self._unlink(path)

    def records(self) -> Iterator[Publication]:
        for name in sorted(os.listdir(self.mounts)):
            if name.endswith(".json"):
                pub = self._read(os.path.join(self.mounts, name))
                if pub is not None:
                    yield pub
