"""The session state that outlives a server process: a record in a memfd that
the keeper holds beside the FUSE connection and hands to every server.

The kernel names nodes by id only, and an id (`Volume.inode(path)`) is a keyed
hash that cannot be inverted: a server that takes a live connection over must
learn the path of every id the kernel may still send. The first server also
keeps the INIT terms here, which its successors never see again.

Layout (little-endian), append-only:

    header   16 bytes  MAGIC (b"FSCLIENT-SAVED", 14 bytes) + u16 FORMAT_VERSION
    record   u32 length of body, u32 crc32 of body, body
    body     u8 kind, then
               TERMS (1): the `Negotiated` terms as JSON (the last one wins)
               NODE  (2): u64 node id, the node's volume path (surrogateescape UTF-8)

A record is visible to every holder of the memfd once its write returns; it
is written before the reply that hands its id to the kernel, so every id the
kernel holds has its record. A server killed in the middle of a write leaves a
torn last record: `load` stops at the first record whose length or crc does
not check, and the next server writes over it. An id's path never changes (the
id is a hash of it), so a node is recorded once per mount, whatever the
kernel's lookup counts: the record grows with the distinct paths the kernel
has looked up, 18 bytes plus the path each.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib

from .negotiate import Negotiated

MAGIC = b"FSCLIENT-SAVED"
FORMAT_VERSION = 1
HEADER = struct.Struct("<14sH")
RECORD = struct.Struct("<II")
NODE = struct.Struct("<BQ")
TERMS, NODE_KIND = 1, 2


class SavedStateError(Exception):
    """The memfd does not hold a saved session of this format."""


def create() -> int:
    """A new, empty saved-state memfd (close-on-exec: it travels by SCM_RIGHTS)."""
    fd = os.memfd_create("fsclient-saved", os.MFD_CLOEXEC)
    os.pwrite(fd, HEADER.pack(MAGIC, FORMAT_VERSION), 0)
    return fd


class SavedState:
    """The records of one mount's memfd: read once when a server starts, then
    appended to by that server alone."""

    def __init__(self, fd: int):
        self.fd = fd
        self.terms: Negotiated | None = None
        self.paths: dict[int, str] = {}
        self.torn = 0  # bytes of a torn last record found by `load`
        self._end = HEADER.size
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> None:
        data = os.pread(self.fd, os.fstat(self.fd).st_size, 0)
        if len(data) < HEADER.size:
            raise SavedStateError("the saved FUSE session is empty; remount")
        magic, version = HEADER.unpack_from(data)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise SavedStateError(f"the saved FUSE session is format {version}, not "
                                  f"{FORMAT_VERSION}: another fsclient version made it; remount")
        off = HEADER.size
        while off + RECORD.size <= len(data):
            length, crc = RECORD.unpack_from(data, off)
            body = data[off + RECORD.size:off + RECORD.size + length]
            if length == 0 or len(body) != length or zlib.crc32(body) != crc:
                break
            self._apply(body)
            off += RECORD.size + length
        self._end = off
        self.torn = len(data) - off

    def _apply(self, body: bytes) -> None:
        if body[0] == TERMS:
            self.terms = Negotiated.from_dict(json.loads(body[1:]))
        elif body[0] == NODE_KIND:
            _, inode = NODE.unpack_from(body)
            self.paths[inode] = body[NODE.size:].decode("utf-8", "surrogateescape")

    def _append(self, body: bytes) -> None:
        with self._lock:
            os.pwrite(self.fd, RECORD.pack(len(body), zlib.crc32(body)) + body, self._end)
            self._end += RECORD.size + len(body)

    def save_terms(self, terms: Negotiated) -> None:
        self.terms = terms
        self._append(bytes([TERMS]) + json.dumps(terms.to_dict()).encode())

    def save_node(self, inode: int, path: str) -> None:
        """Record `inode`'s path, once per mount."""
        if self.paths.get(inode) == path:
            return
        self.paths[inode] = path
        self._append(NODE.pack(NODE_KIND, inode) + path.encode("utf-8", "surrogateescape"))

    def size(self) -> int:
        return self._end
