"""The read path of `Volume`: what a read starts in at the top, the parts in rooms.

Top: `volume` (the `Volume` facade), `volumefile` (its file object), `handle`
(`FileHandle`, one open file: its version, its one sequential detector, the
chunk path of random reads, read-ahead and the block files it holds; the
FUSE client reads through it too), `readpath` (the walk of one read over
its blocks), `parts` (the typed view of a volume's pieces the rooms are
handed, never the `Volume`), `options`, `prefetchahead` (`prefetch_ahead`).

Rooms, each importing only those below it (pyproject's import contracts):
- `ahead/`: what is fetched before a read asks (`sequential` runs and
  windows, `prefetch`, `hostfill` for `prefetch_ahead`);
- `misses/`: what the source or the tier is asked for (`metadata`,
  `coldopen`, `fetch` once per block, `tier`, `fills` sealing for the daemon);
- `hits/`: what this host holds (`blockhits`: the memory LRU, then the cache
  disk; `chunks`, `chunkhits`, `blockfds`, `handlehits`: small random reads;
  `ciphers`, `decrypt`).
"""

from .handle import FileHandle

__all__ = ["FileHandle"]
