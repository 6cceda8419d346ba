"""Which files a warmup covers: the paths given (arguments, then a file list)
resolved to the volume's files, and directories walked, all streaming and
bounded (see the package doc)."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

from blockcache_client.contract.errors import BlockcacheError
from blockcache_client.sources.fileinfo import FileInfo, normalize

from .interrupts import wait_result

LIST_AHEAD = 8             # directory listings fetched ahead of the walk


@dataclass
class Target:
    """One path as the user gave it, and what it resolved to."""

    given: str
    rel: str
    error: str | None = None


def to_volume_path(path: str, mountpoint: str | None) -> str:
    """A path as given (volume-relative, or absolute under the mount point) to
    the volume-relative form; ValueError for an absolute path elsewhere."""
    if mountpoint and os.path.isabs(path):
        mp = os.path.normpath(mountpoint)
        p = os.path.normpath(path)
        if p == mp:
            return ""
        if not p.startswith(mp + os.sep):
            raise ValueError(f"{path} is not under the mount point {mountpoint}")
        path = p[len(mp) + 1:]
    return normalize(path)


def read_file_list(stream: TextIO) -> Iterator[str]:
    """Paths from a file list, one a line, lazily; blank lines and '#' comments skipped."""
    for line in stream:
        line = line.rstrip("\r\n")
        if line and not line.startswith("#"):
            yield line


def targets(paths: Iterable[str], file_list: Iterable[str],
            mountpoint: str | None) -> Iterator[Target]:
    """Every path argument, then every file list entry; the root if there are none."""
    any_given = False
    for source in (paths, file_list):
        for given in source:
            any_given = True
            try:
                yield Target(given, to_volume_path(given, mountpoint))
            except (ValueError, OSError) as exc:
                yield Target(given, "", error=str(exc))
    if not any_given:
        yield Target("/", "")


def walk(volume: Any, info: FileInfo,
         on_error: Callable[[str, BaseException], None] | None = None,
         pool: ThreadPoolExecutor | None = None, ahead: int = LIST_AHEAD,
         on_link: Callable[[FileInfo], None] | None = None) -> Iterator[FileInfo]:
    """Regular files at or beneath `info`, depth first.

    With a `pool`, the listings of the next `ahead` directories to visit run
    in parallel while this one's files are handed out (a remote listing is a
    round trip; one at a time, a tree of many small dirs would be walked at
    the speed of its latency). Outstanding listings stay bounded: at most
    `ahead` per level of depth. A directory that cannot be listed goes to
    `on_error` (the walk goes on) or, without one, raises. Symbolic links
    are not followed; `on_link` hears of each."""
    if info.is_link:
        if on_link is not None:
            on_link(info)
        return
    if not info.is_dir:
        yield info
        return
    stack = [info.path]
    listing: dict[str, Future] = {}
    while stack:
        if pool is not None:
            for p in stack[-ahead:]:
                if p not in listing:
                    listing[p] = pool.submit(volume.backend.listdir, p)
        d = stack.pop()
        dirs = []
        try:
            fut = listing.pop(d, None)
            entries = wait_result(fut) if fut is not None else volume.backend.listdir(d)
        except (OSError, BlockcacheError) as exc:
            if on_error is None:
                raise
            on_error(d, exc)
            continue
        for entry in entries:
            if entry.is_link:
                if on_link is not None:
                    on_link(entry)
                continue
            if entry.is_dir:
                dirs.append(entry.path)
            else:
                yield entry
        stack.extend(reversed(dirs))


def bounded_map(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: Iterable[Any],
                window: int) -> Iterator[tuple[Any, Future]]:
    """(item, future of fn(item)) in the order of `items`, with at most `window`
    submitted ahead (ThreadPoolExecutor.map would consume `items` whole first)."""
    pending: collections.deque[tuple[Any, Future]] = collections.deque()
    for item in items:
        pending.append((item, pool.submit(fn, item)))
        if len(pending) >= window:
            yield pending.popleft()
    while pending:
        yield pending.popleft()


def resolved(volume: Any, pool: ThreadPoolExecutor, items: Iterable[Target],
             window: int) -> Iterator[tuple[Target, FileInfo | None]]:
    """(target, its FileInfo or None with target.error set), stat-ed in parallel, in order."""
    def stat(t: Target) -> FileInfo | None:
        return None if t.error else volume.backend.stat(t.rel)

    for t, fut in bounded_map(pool, stat, items, window):
        try:
            info = wait_result(fut)
        except (OSError, BlockcacheError) as exc:
            t.error = reason(exc)
            info = None
        yield t, info


def reason(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "not found in the volume"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({exc.__class__.__name__})" if not exc.filename else str(exc)
    return str(exc) or exc.__class__.__name__
