"""The cluster tier: hosts share sealed blocks through a memcached pool.

- `config`: the `[cluster]` settings as the daemon hands them out in `hello`;
- `items`: how a block file is cut into memcached items (slices) and checked;
- `pool`: the servers (rendezvous placement, DNS refresh, timeouts, dead
  servers skipped and retried) and the process's asynchronous tier filler.

The reader's use of it (read order, authentication, hand-off to the daemon)
is `blockcache_client.reader.tier`.
"""
