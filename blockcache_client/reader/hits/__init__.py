"""Hits: a block's bytes from what this host holds.

`blockhits` (`HitReader`): the memory LRU (`memory`), then the cache disk,
whose block files the reader opens and decrypts itself (`ciphers`: derived
block ciphers; `decrypt`: large reads on every core). Small random reads go
through `chunkhits`: decrypted pages and chunks kept in the LRU (`chunks`),
block files held open for open handles (`blockfds`), whose repeat hits of
kept chunks are served by the handle's short path (`handlehits`). Nothing
here asks the source or the tier (`misses`).
"""
