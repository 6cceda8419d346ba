"""`Volume`'s cache control: which blocks of a file are cached, fetching
some ahead (`prefetch`), and evicting a file's blocks.

A mixin over the Volume's per-process parts: `block_map` checks each block
file through the layout (no daemon round trip, no read), `prefetch` hands
ranges to the prefetcher (never blocking on the source), `evict` asks the
daemon to drop every version of a file.
"""

from __future__ import annotations

import logging

from ..contract.errors import DaemonError, DaemonUnavailable
from ..sources.fileinfo import FileInfo, normalize
from . import options

log = logging.getLogger(__name__)


class VolumeCache:
    """The cache-control methods `Volume` has."""

    def _block_len(self, info: FileInfo, boff: int) -> int:
        return min(self.block_size, info.size - boff)

    def _blocks(self, path: str, info: FileInfo | None, offset: int = 0,
                length: int | None = None):
        rel, info = self._resolve(path, info)
        prefix = self._key_prefix(rel, info.version)
        end = info.size if length is None else min(info.size, offset + length)
        bs = self.block_size
        for b in range(offset // bs, -(-end // bs)):
            yield rel, info, prefix + format(b * bs, "016x"), b * bs

    def prefetch(self, path: str, offset: int, length: int, info: FileInfo | None = None) -> None:
        """Fetch the blocks of [offset, offset+length) into the cache in the
        background (readahead): consecutive missing blocks in one request of
        up to a part (`options.PART_BYTES`), one job per part so parts arrive
        in parallel. Never blocks on the backend, never raises for I/O."""
        self._proc()
        options.check_range(path, offset, length)
        rel = normalize(path)
        if info is None:  # stat-ing could block: do it in the background too
            self._prefetcher.submit(self._prefetch_range, rel, offset, length, None)
        else:
            self._prefetch_range(rel, offset, length, info)

    def _prefetch_range(self, rel: str, offset: int, length: int, info: FileInfo | None) -> None:
        try:
            rel, info = self._resolve(rel, info)
            self._prefetcher.windows(rel, info, self._key_prefix(rel, info.version), offset,
                                     length)
        except Exception as exc:  # readahead is best effort; the real read reports errors
            log.debug("prefetch %s failed: %s", rel, exc)

    def cached_bytes(self, path: str, info: FileInfo | None = None) -> int:
        """Plaintext bytes of this file (this version) in the host cache now."""
        return sum(n for _, n, cached in self.block_map(path, info) if cached)

    def block_map(self, path: str, info: FileInfo | None = None) -> list[tuple[int, int, bool]]:
        """(offset, length, cached now) of each block of this file version, in
        order; "cached" checks the block file through the layout (no daemon
        round trip, no read). Warmup uses it to fetch only what is missing."""
        self._proc()
        return [(boff, self._block_len(info, boff), self._hits.is_cached(key))
                for _, info, key, boff in self._blocks(path, info)]

    def evict(self, path: str, info: FileInfo | None = None) -> int:
        """Remove this file's blocks (every version) from the cache; returns how
        many the daemon removed (0 if it is unreachable)."""
        self._proc()
        rel = normalize(path)
        ino = self.names.inode(rel)
        self._mem.discard_prefix(f"{self.name}_{ino}_")
        try:
            return self._link.evict_inode(self.name, ino)
        except (DaemonUnavailable, DaemonError) as exc:
            self.counters.add("daemon_unavailable")
            log.info("evict %s: %s", rel, exc)
            return 0
