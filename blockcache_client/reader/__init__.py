"""The read path of `Volume`, one concern a module.

`Volume.read` walks down this package once: `metadata` (the file's version)
-> block keys -> `readpath` (the walk over the read's blocks) -> `hits` (the
memory LRU, `memory`, then the cache disk) or `fetch` (the source, once per
block at a time: `singleflight`; `fills` seals what it brought for the
daemon) -> back to the caller. Hits, the tier and the sealer share one cache
of derived block ciphers (`ciphers`). An open file is a `handle.FileHandle`
(`Volume.open`'s file object and the FUSE client read through one): its
version, its one sequential detector, its chunk path and read-ahead. Small
random reads go through `chunkhits`: decrypted chunks kept in the memory LRU
(`chunks`), block files held open for open handles (`blockfds`); a handle
serves its repeat hits of kept chunks itself (`handlehits`). `sequential`
decides how many blocks a miss may bring, and `prefetch` fetches ahead in
the background. The parts get a typed view of what they use (`parts`), not
the `Volume`. No module calls back up.

Beside the read path: `ahead` (`prefetch_ahead`) walks an epoch's order ahead
of readers in other processes, putting each file into the host cache with
`hostfill`, and yields it once the daemon has written it.
"""

from .handle import FileHandle

__all__ = ["FileHandle"]
