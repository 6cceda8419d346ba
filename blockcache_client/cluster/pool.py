"""The memcached servers of the cluster tier, as one process uses them.

- Placement: weighted-rendezvous hashing (`contract.layout.rendezvous_score`,
  equal weights) of the block key over the live servers, so all slices of a
  block live on one server, one multi-get reads them, and a server that
  leaves moves only its own share.
- Failure costs a bounded time: each server has a connect timeout and a read
  timeout in milliseconds. A server that fails (refused, reset, timed out) is
  skipped for `retry_after` seconds: its blocks are then placed on the next
  server in rendezvous order (a miss there, then a fill), and it is tried
  again after that. Every failure is counted (`cluster_errors`).
- Membership: IP literals are used as given; a DNS name is resolved to all
  its addresses on a background thread, again every `dns_refresh` seconds.
  Until the first answer its addresses simply are not members (misses).
- Fills: `add` (never overwrites what another host stored) on one filler
  thread, from a queue bounded in bytes that drops and counts when full.

One `Pool` per process and configuration (`pool_for`); a forked child makes
its own (sockets and threads do not survive a fork).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterable

from pymemcache.client.base import PooledClient
from pymemcache.exceptions import MemcacheClientError, MemcacheError

from ..contract.cluster import ClusterConfig, is_ip, parse_server
from ..contract.layout import rendezvous_score
from ..counters import Counters

log = logging.getLogger(__name__)

# errors that mean the server (or the way to it) failed, not our request
_SERVER_ERRORS = (OSError, MemcacheError)
_POOL_PER_SERVER = 16   # connections kept per server (reader threads at once)


class _TLSName:
    """An SSL context that checks the name the entry was configured with,
    not the address it resolved to (pymemcache passes the address)."""

    def __init__(self, context: ssl.SSLContext, name: str):
        self._context, self._name = context, name

    def wrap_socket(self, sock: socket.socket, server_hostname: str | None = None):
        return self._context.wrap_socket(sock, server_hostname=self._name)


class Server:
    """One memcached address: its connections and when it may be used again."""

    __slots__ = ("name", "client", "dead_until")

    def __init__(self, name: str, address: tuple[str, int], cfg: ClusterConfig,
                 tls: _TLSName | None):
        self.name = name
        self.dead_until = 0.0
        self.client = PooledClient(address, connect_timeout=cfg.connect_timeout,
                                   timeout=cfg.timeout, no_delay=True,
                                   max_pool_size=_POOL_PER_SERVER, tls_context=tls)


class Pool:
    """The tier's servers for one configuration, in one process."""

    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self._tls_context = _tls_context(cfg) if cfg.tls else None
        self._lock = threading.Lock()
        self._servers: dict[str, Server] = {}       # by "addr:port"
        self._by_entry: dict[str, list[str]] = {}   # entry -> its current addresses
        self._closed = threading.Event()
        names = []
        for entry in cfg.memcached:
            host, port = parse_server(entry)
            if is_ip(host):
                self._set_addresses(entry, host, [(host, port)])
            else:
                names.append(entry)
        self.live: list[Server] = list(self._servers.values())
        # fills: (counters, item list, bytes) jobs, bounded by bytes
        self._fills: collections.deque = collections.deque()
        self._fill_bytes = 0
        self._fill_cv = threading.Condition()
        self._threads = [threading.Thread(target=self._fill_loop, name="blockcache-tier-fill",
                                          daemon=True)]
        if names:
            self._threads.append(threading.Thread(target=self._dns_loop, args=(names,),
                                                  name="blockcache-tier-dns", daemon=True))
        for t in self._threads:
            t.start()

    # -- placement and failures ---------------------------------------------------

    def owner(self, key: str) -> Server | None:
        """The live server that holds `key`'s block, or None (no live server)."""
        now = time.monotonic()
        best, best_score = None, -1.0
        for server in self.live:
            if server.dead_until > now:
                continue
            score = rendezvous_score(server.name, 1, key)
            if score > best_score:
                best, best_score = server, score
        return best

    def failed(self, server: Server, exc: BaseException, counters: Counters) -> None:
        """Count a server's failure and skip it for `retry_after` seconds."""
        counters.add("cluster_errors")
        if server.dead_until <= time.monotonic():
            log.warning("memcached %s failed (%s: %s); skipping it for %.3gs",
                        server.name, type(exc).__name__, exc, self.cfg.retry_after)
        server.dead_until = time.monotonic() + self.cfg.retry_after

    # -- requests (never raise for a server's failure) ----------------------------

    def get_many(self, blocks: dict[str, list[str]], counters: Counters
                 ) -> dict[str, bytes]:
        """The items found of several blocks ({block key: item names}): one
        multi-get per server that holds some; a failing server's are missing."""
        by_server: dict[Server, list[str]] = {}
        for block_key, names in blocks.items():
            server = self.owner(block_key)
            if server is not None:
                by_server.setdefault(server, []).extend(names)
        found: dict[str, bytes] = {}
        for server, names in by_server.items():
            try:
                found.update(server.client.get_many(names))
            except MemcacheClientError as exc:  # our request, not the server: no skipping
                log.debug("memcached refused a get at %s: %s", server.name, exc)
                counters.add("cluster_errors")
            except _SERVER_ERRORS as exc:
                self.failed(server, exc, counters)
        return found

    def delete(self, block_key: str, names: Iterable[str], counters: Counters) -> None:
        """Remove a bad block's items (all of them: a later fill stores it anew)."""
        server = self.owner(block_key)
        if server is None:
            return
        try:
            server.client.delete_many(list(names), noreply=False)
        except _SERVER_ERRORS as exc:
            self.failed(server, exc, counters)

    def offer_fill(self, block_key: str, items: list[tuple[str, bytes]],
                   counters: Counters) -> bool:
        """Queue a sealed block's items for `add`; False (counted) if the
        queue is full. Never blocks."""
        size = sum(len(v) for _, v in items)
        with self._fill_cv:
            if self._fill_bytes + size > self.cfg.fill_queue_bytes or self._closed.is_set():
                counters.add("cluster_fills_dropped")
                return False
            self._fills.append((block_key, items, size, counters))
            self._fill_bytes += size
            self._fill_cv.notify()
        return True

    def wait_fills(self, timeout: float) -> bool:
        """Until the fill queue is empty and its last job done (tests, warmup)."""
        deadline = time.monotonic() + timeout
        with self._fill_cv:
            while self._fills or self._fill_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._fill_cv.wait(left)
        return True

    def _fill_loop(self) -> None:
        while True:
            with self._fill_cv:
                while not self._fills and not self._closed.is_set():
                    self._fill_cv.wait()
                if self._closed.is_set():
                    return
                block_key, items, size, counters = self._fills.popleft()
            try:
                self._add(block_key, items, counters)
            except Exception:  # never let one job stop the filler
                log.exception("tier fill of %s failed", block_key)
            finally:
                with self._fill_cv:
                    self._fill_bytes -= size
                    self._fill_cv.notify_all()

    def _add(self, block_key: str, items: list[tuple[str, bytes]], counters: Counters) -> None:
        server = self.owner(block_key)
        if server is None:
            counters.add("cluster_fills_dropped")
            return
        stored = False
        try:
            for name, value in items:
                # `add`: what the tier holds already (another host's copy) stays
                stored |= bool(server.client.add(name, value, noreply=False))
        except _SERVER_ERRORS as exc:
            self.failed(server, exc, counters)
            counters.add("cluster_fills_dropped")
            return
        if stored:
            counters.add("cluster_fills_sent")

    # -- membership ----------------------------------------------------------------

    def _set_addresses(self, entry: str, host: str, addresses: list[tuple[str, int]]) -> None:
        names = []
        for addr, port in addresses:
            name = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
            names.append(name)
            if name not in self._servers:
                tls = None if self._tls_context is None else _TLSName(self._tls_context, host)
                self._servers[name] = Server(name, (addr, port), self.cfg, tls)
        self._by_entry[entry] = names

    def _dns_loop(self, entries: list[str]) -> None:
        while not self._closed.is_set():
            for entry in entries:
                host, port = parse_server(entry)
                try:
                    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except OSError as exc:  # keep the last answer; try again next round
                    log.warning("memcached %s: cannot resolve %s (%s); keeping %d "
                                "address(es)", entry, host, exc, len(self._by_entry.get(entry, ())))
                    continue
                addresses = sorted({(i[4][0], port) for i in infos})
                with self._lock:
                    self._set_addresses(entry, host, addresses)
                    self._publish()
            self._closed.wait(self.cfg.dns_refresh)

    def _publish(self) -> None:
        """Make the current members live; close the servers that left."""
        current = {n for names in self._by_entry.values() for n in names}
        for name in [n for n in self._servers if n not in current]:
            self._servers.pop(name).client.close()
        self.live = [self._servers[n] for n in sorted(current)]

    def close(self) -> None:
        self._closed.set()
        with self._fill_cv:
            self._fill_cv.notify_all()
        for t in self._threads:
            t.join(1.0)
        for server in list(self._servers.values()):
            server.client.close()


def _tls_context(cfg: ClusterConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=cfg.tls_ca_file)
    if cfg.tls_cert_file:
        context.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    return context


_pools: dict[tuple[int, ClusterConfig], Pool | None] = {}
_pools_lock = threading.Lock()


def pool_for(cfg: ClusterConfig) -> Pool | None:
    """This process's pool for `cfg` (shared by its volumes), or None if its
    TLS files cannot be loaded (logged: the tier is then off, reads go on)."""
    ident = (os.getpid(), cfg)
    try:
        return _pools[ident]
    except KeyError:
        pass
    with _pools_lock:
        if ident not in _pools:
            try:
                _pools[ident] = Pool(cfg)
            except (OSError, ssl.SSLError, ValueError) as exc:  # once: not at every read
                log.error("cluster tier off: cannot set up TLS for memcached (%s); check "
                          "tls_ca_file, tls_cert_file and tls_key_file", exc)
                _pools[ident] = None
        return _pools[ident]
