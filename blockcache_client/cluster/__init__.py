"""The cluster tier: hosts share sealed blocks through a memcached pool.

- `items`: how a block file is cut into memcached items (slices) and checked;
- `memcache`: a small memcached client (text protocol, timeouts, TLS, pooled
  connections);
- `pool`: the servers (rendezvous placement, DNS refresh, timeouts, dead
  servers skipped and retried) and the process's asynchronous tier filler.

The `[cluster]` settings, as the daemon hands them out in `hello`, are
`blockcache_client.contract.cluster`. The reader's use of the tier (read
order, authentication, hand-off to the daemon) is
`blockcache_client.reader.misses.tier`.
"""
