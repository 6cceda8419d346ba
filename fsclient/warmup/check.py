"""`--check` and `--evict`: per path given, how much is cached, or remove its
blocks; printed as they come, with a total line."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

from blockcache_client.contract.errors import BlockcacheError
from blockcache_client.contract.units import format_size

from .interrupts import EXIT_FAILED, EXIT_INTERRUPTED, Interrupted
from .targets import Target, reason, resolved, walk


@dataclass
class PathReport:
    """Cached bytes of one given path (a file, or a directory's files summed)."""

    given: str
    files: int = 0
    size: int = 0
    cached: int = 0
    evicted: int = 0
    error: str | None = None


def inspect(volume: Any, pool: ThreadPoolExecutor, items: Iterable[Target], window: int,
            evict: bool) -> Iterator[PathReport]:
    """Per target: its cached bytes (`--check`) or the blocks evicted (`--evict`)."""
    for target, info in resolved(volume, pool, items, window):
        r = PathReport(target.given)
        if info is None:
            r.error = target.error
            yield r
            continue
        try:
            for f in walk(volume, info, pool=pool):
                r.files += 1
                r.size += f.size
                if evict:
                    r.evicted += volume.evict(f.path, f)
                else:
                    r.cached += volume.cached_bytes(f.path, f)
        except (OSError, BlockcacheError) as exc:
            r.error = reason(exc)
        yield r


def pct(cached: int, size: int) -> str:
    return f"{100.0 * cached / size:6.1f}%" if size else "   100%"


def check_line(r: PathReport) -> str:
    if r.error:
        return f"  error   {r.given}: {r.error}"
    return (f"{pct(r.cached, r.size)}  {format_size(r.cached):>10} of "
            f"{format_size(r.size):<10}  {r.files:>7} files  {r.given}")


def run_check(volume: Any, mode: str, items: Iterable[Target], parallel: int, out: TextIO) -> int:
    evict = mode == "evict"
    total = PathReport("total")
    failed = 0
    pool = ThreadPoolExecutor(parallel, thread_name_prefix="warmup-stat")
    try:
        for r in inspect(volume, pool, items, 2 * parallel, evict):
            if r.error:
                failed += 1
            total.files += r.files
            total.size += r.size
            total.cached += r.cached
            total.evicted += r.evicted
            if evict:
                out.write(f"  error   {r.given}: {r.error}\n" if r.error else
                          f"evicted {r.evicted:>7} blocks  {r.files:>7} files  {r.given}\n")
            else:
                out.write(check_line(r) + "\n")
            out.flush()
    except Interrupted as exc:
        out.write(f"interrupted ({exc})\n")
        return EXIT_INTERRUPTED
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if evict:
        out.write(f"evicted {total.evicted} blocks of {total.files} files"
                  f"{f'; {failed} paths failed' if failed else ''}\n")
    else:
        out.write(f"total: {pct(total.cached, total.size).strip()} cached "
                  f"({format_size(total.cached)} of {format_size(total.size)}) in "
                  f"{total.files} files{f'; {failed} paths failed' if failed else ''}\n")
    return EXIT_FAILED if failed else 0
