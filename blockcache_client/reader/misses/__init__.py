"""Misses: what is asked of the source, or of the cluster tier.

`metadata`: a file's version (stats and listings, cached by age);
`coldopen`: a file of a cold directory opened by its first block's GET;
`fetch`: a block this host does not hold, once however many threads ask
(`singleflight`), from the tier (`tier`) or the source, kept in the memory
LRU and sealed once for the daemon and the tier (`fills`).
"""
