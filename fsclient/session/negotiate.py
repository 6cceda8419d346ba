"""INIT: what this session and the kernel agreed on, once per connection.

The kernel sends INIT once, as the first request of a connection; a process that
takes a live connection over (the keeper's successor) never sees it, so the result
is kept in `Negotiated`, which round-trips through a plain dict (`to_dict`,
`from_dict`) for the keeper to hand on.

What a read-only cache asks for, when the kernel offers it:
- async reads (the kernel's readahead runs beside the reader's own reads),
- parallel lookups and readdirs in one directory,
- readdirplus on every listing (one request names and describes a page of entries:
  a 100k-entry directory then needs no lookup per name),
- `max_pages` 256 (1 MiB reads, with the mount's 1 MiB readahead window),
- cached symlink targets, lookups of "." and ".." (NFS export), automatic
  invalidation of cached pages when a file's size or mtime changes.

`FSCLIENT_FUSE_MINOR` (a test and diagnostic knob, not a setting): speak at most
that minor, as a kernel of that version would, and take the INIT flags it offers
as that kernel would offer them. `FSCLIENT_FUSE_MINOR=39` on Linux 6.9+ is how an
older kernel's mount (no FUSE_NOTIFY_RESEND) is tested; the kernel follows the
minor the server answers, and the session never resends below 7.40.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from . import structs as s

# 1 MiB reads: the mount's readahead window (mount.KERNEL_READAHEAD_KB) and the
# largest block piece a read request asks for.
MAX_PAGES = 256
# A read-only mount is sent no writes: the kernel's minimum write size keeps
# the read buffer small. A writable mount takes 1 MiB writes (max_pages).
MAX_WRITE = 128 << 10
WRITABLE_MAX_WRITE = 1 << 20
# Background requests (async reads, readahead) the kernel keeps in flight.
MAX_BACKGROUND = 64
CONGESTION_THRESHOLD = 48
WANTED = (s.ASYNC_READ | s.PARALLEL_DIROPS | s.DO_READDIRPLUS | s.MAX_PAGES
          | s.CACHE_SYMLINKS | s.EXPORT_SUPPORT | s.AUTO_INVAL_DATA | s.ASYNC_DIO)
FORCED_MINOR = "FSCLIENT_FUSE_MINOR"


class ProtocolError(Exception):
    """The kernel speaks a FUSE protocol this session cannot."""


@dataclasses.dataclass(frozen=True)
class Negotiated:
    """The connection's terms: the protocol version both speak and what was granted."""

    major: int
    minor: int
    flags: int              # INIT flags granted (those the kernel offered and we want)
    offered: int            # INIT flags the kernel offered (flags | flags2 << 32)
    max_readahead: int
    max_write: int
    max_pages: int
    max_background: int
    congestion_threshold: int
    time_gran: int = 1

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)

    @property
    def resends(self) -> bool:
        """The kernel queues again, when asked, what a dead server had read
        (FUSE_NOTIFY_RESEND, 7.40): without it a server must answer all it read."""
        return self.minor >= s.RESEND_MINOR

    def buffer_size(self) -> int:
        """The request buffer each channel reads into: a header, the largest
        request body the kernel may send (a write, sent only to a writable
        mount, or a setxattr of up to 64 KiB) and a page of slack."""
        return max(s.MIN_READ_BUFFER, self.max_write + 4096 + s.IN_HEADER.size)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Negotiated:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"saved FUSE session terms have unknown keys {sorted(unknown)}; "
                             f"they were saved by another fsclient version: remount")
        return cls(**{k: int(v) for k, v in data.items()})


def max_write(writable: bool) -> int:
    return WRITABLE_MAX_WRITE if writable else MAX_WRITE


def negotiate(body: bytes | memoryview, writable: bool = False) -> tuple[Negotiated, bytes]:
    """The terms for the kernel's INIT request body, and the fuse_init_out reply.
    ProtocolError for a major version other than 7 or a minor below MIN_MINOR.
    A `writable` mount takes 1 MiB writes and O_TRUNC in OPEN (ATOMIC_O_TRUNC:
    an open that truncates is one request, which stages the file empty)."""
    if len(body) < s.INIT_IN_OLD.size:
        raise ProtocolError(f"INIT request of {len(body)} bytes is too short")
    major, minor, readahead, flags = s.INIT_IN_OLD.unpack_from(body)
    flags2 = s.INIT_IN.unpack_from(body)[4] if len(body) >= s.INIT_IN.size else 0
    if major != s.KERNEL_MAJOR:
        raise ProtocolError(f"the kernel speaks FUSE {major}.{minor}; fsclient speaks "
                            f"{s.KERNEL_MAJOR}.x")
    if minor < s.MIN_MINOR:
        raise ProtocolError(f"the kernel speaks FUSE 7.{minor}; fsclient needs 7.{s.MIN_MINOR} "
                            f"or newer (Linux 5.4+)")
    offered = flags | (flags2 << 32 if flags & s.INIT_EXT else 0)
    forced = forced_minor()
    if forced is not None and forced < minor:
        minor = forced
        offered &= s.flags_of_minor(minor)
    wanted = WANTED | (s.ATOMIC_O_TRUNC if writable else 0)
    terms = Negotiated(major=s.KERNEL_MAJOR, minor=min(minor, s.KERNEL_MINOR),
                       flags=flags & wanted, offered=offered, max_readahead=readahead,
                       max_write=max_write(writable),
                       max_pages=MAX_PAGES if flags & s.MAX_PAGES else 0,
                       max_background=MAX_BACKGROUND, congestion_threshold=CONGESTION_THRESHOLD)
    reply = s.INIT_OUT.pack(terms.major, terms.minor, terms.max_readahead, terms.flags,
                            terms.max_background, terms.congestion_threshold, terms.max_write,
                            terms.time_gran, terms.max_pages, 0, 0, 0, 0)
    return terms, reply


def forced_minor() -> int | None:
    """The minor FSCLIENT_FUSE_MINOR caps the session at, or None (unset);
    ProtocolError naming the variable for a value no kernel fsclient serves speaks."""
    raw = os.environ.get(FORCED_MINOR, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not s.MIN_MINOR <= value <= s.KERNEL_MINOR:
        raise ProtocolError(f"{FORCED_MINOR}={raw!r} is not a FUSE minor fsclient speaks "
                            f"({s.MIN_MINOR} to {s.KERNEL_MINOR}); unset it, or set e.g. 39")
    return value
