"""What the reader's parts are handed: a typed view of one volume's
per-process pieces, built by `Volume` (a forked child builds new ones), so
that a read's walk (`readpath`), an open handle (`handle`, `handlehits`) and
a host fill (`hostfill`) use what they need, never the facade itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..common.counters import Counters
from ..daemonclient.link import DaemonLink
from .ahead.prefetch import Prefetcher
from .ahead.sequential import SequentialReads
from .hits.blockfds import BlockFiles
from .hits.blockhits import HitReader
from .misses.fetch import Fetcher


@dataclass(frozen=True, slots=True)
class ReadParts:
    """What a read of one volume in one process uses: built by `Volume` per
    process (a fork builds new ones), handed to the read's walk and to
    open handles instead of the whole `Volume`."""

    name: str
    block_size: int
    window: int                               # blocks one sequential request may bring
    hits: HitReader
    fetcher: Fetcher
    sequential: SequentialReads
    prefetcher: Prefetcher
    files: BlockFiles                         # block files held for open handles
    link: DaemonLink
    counters: Counters
    chunk_size: int
    key_prefix: Callable[[str, str], str]     # (path, version) -> the blocks' key prefix
