"""What a volume knows about one entry, and the one form of a volume path.

Paths are relative to the volume root, '/'-separated, without a leading
'/'. Only '/' separates components: any other byte a POSIX name or an S3 key
may hold (a backslash, a newline, '#', '%') is part of a name. A path with a
`..` or `.` component, or a NUL byte, cannot name anything inside the volume
and is refused (EINVAL). `info_of` turns what any fsspec filesystem reports
into a `FileInfo`, whose `version` the block keys derive from.
"""

from __future__ import annotations

import datetime
import errno
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FileInfo:
    """What a volume knows about one entry.

    `path` is relative to the volume root (no leading '/'; "" is the root).
    `version` names this exact content: the ETag when the backend has one,
    else f"{mtime_ns}-{size}"; block keys derive from it. For a symbolic link
    (`is_link`) size and version are its target's, what a read gets; `target`
    is the link's own text where the backend reports it (lstat's size is its
    length).
    """

    path: str
    name: str
    size: int
    is_dir: bool
    is_link: bool
    mtime_ns: int
    version: str
    mode: int | None = None
    target: str | None = None


def normalize(path: str) -> str:
    """The canonical volume-relative form of `path`; OSError(EINVAL) if it could
    name something outside the volume."""
    if not isinstance(path, str):
        raise TypeError(f"volume path must be a str, not {type(path).__name__}")
    if "\0" in path:
        raise OSError(errno.EINVAL, f"path {path!r} contains a NUL byte, which no file "
                                    f"name can hold")
    parts = [p for p in path.split("/") if p]
    for p in parts:
        if p in (".", ".."):
            raise OSError(errno.EINVAL, f"path {path!r} has a {p!r} component and could "
                                        f"escape the volume root; use a plain relative path")
    return "/".join(parts)


def is_canonical_name(name: str) -> bool:
    """True if `name` is one path component `normalize` keeps exactly as it is
    (not empty, no '/' or NUL, not '.' or '..'): only such entries are listed."""
    return (bool(name) and name != "." and name != ".." and "/" not in name
            and "\0" not in name)


def mtime_ns_of(raw: dict) -> int:
    for name in ("mtime", "LastModified", "last_modified", "modified", "updated", "created",
                 "timeCreated"):
        v = raw.get(name)
        if v is None:
            continue
        if isinstance(v, datetime.datetime):
            if v.tzinfo is None:
                v = v.replace(tzinfo=datetime.UTC)
            return int(v.timestamp() * 1_000_000) * 1000
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return int(round(v * 1e9))
        if isinstance(v, str):
            try:
                when = datetime.datetime.fromisoformat(v.replace("Z", "+00:00"))
                return mtime_ns_of({"mtime": when})
            except ValueError:
                continue
    return 0


def stat_version(mtime_ns: int, size: int) -> str:
    """The version of a file without an ETag: what its block keys derive from,
    and what a versioned local read checks the open file against."""
    return f"{mtime_ns}-{size}"


def link_target(raw: dict) -> str | None:
    dest = raw.get("destination") if raw.get("islink") else None
    return dest if isinstance(dest, str) else None


def _etag(raw: dict) -> str | None:
    for name in ("ETag", "etag", "e_tag", "md5Hash"):
        v = raw.get(name)
        if v:
            return str(v).strip('"')
    return None


def info_of(raw: dict, rel: str) -> FileInfo:
    """The FileInfo of an fsspec info dict `raw` naming volume path `rel`."""
    size = int(raw.get("size") or 0)
    mtime_ns = mtime_ns_of(raw)
    mode = raw.get("mode")
    return FileInfo(
        path=rel,
        name=rel.rsplit("/", 1)[-1],
        size=size,
        is_dir=raw.get("type") == "directory",
        is_link=bool(raw.get("islink")),
        mtime_ns=mtime_ns,
        version=_etag(raw) or stat_version(mtime_ns, size),
        mode=(int(mode) & 0o7777) if isinstance(mode, int) else None,
        target=link_target(raw),
    )
