"""The memcached servers of the cluster tier, as one process uses them.

- Placement: weighted-rendezvous hashing (`contract.layout.rendezvous_score`,
  equal weights) of the block key over the live servers, so all slices of a
  block live on one server, one multi-get reads them, and a server that
  leaves moves only its own share.
- Failure costs a bounded time: each server has a connect timeout and a read
  timeout in milliseconds, and a request a deadline (the read timeout plus
  its bytes at `memcache.MIN_RATE`), so a value trickling in is cut off.
  A reply that is not what was asked for (a second value for a name, a
  size other than the item's) fails the server before a byte is placed;
  the caller hears of an item of the wrong size first, to delete it.
  A server that fails (refused, reset, timed out) is skipped for
  `retry_after` seconds: its blocks are then placed on the next server in
  rendezvous order (a miss there, then a fill), and it is tried again after
  that. Every failure is counted (`cluster_errors`).
- Slow is not dead: a server gone or broken refuses or resets; one that
  times out may be stalled or only busy. So a timeout also starts a probe
  (`version` on a new connection, waiting up to `retry_after`): if it
  answers, the server is used again at once; a stalled one stays skipped.
  A server that probes brought back `REVIVALS` times within `retry_after`
  and times out again is skipped without a probe, so one that answers
  probes but not reads costs the reads in flight at most `REVIVALS` + 1
  timeouts per `retry_after`, while a server busy now and then (an
  overloaded host) is not lost for `retry_after` at its second timeout.
- Membership: IP literals are used as given; a DNS name is resolved to all
  its addresses when the pool is made (a volume's first connection to the
  daemon), then on a background thread every `dns_refresh` seconds. A name
  that does not resolve has no members until it does (misses, not errors).
- Fills: `add` of a block's first item, and the rest only if that went in
  (never overwriting another host's copy, never mixing two), on one filler
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
from collections.abc import Callable, Iterable

from ..common.counters import Counters
from ..contract.cluster import ClusterConfig, is_ip, parse_server
from ..contract.layout import rendezvous_score
from .memcache import Memcache, Place, Refused, ServerFailed

log = logging.getLogger(__name__)

REVIVALS = 3  # probes that may bring a timed-out server back per retry_after


class Server:
    """One memcached address: its connections and when it may be used again."""

    __slots__ = ("name", "client", "dead_until", "refusals", "probing", "revivals")

    def __init__(self, name: str, client: Memcache):
        self.name = name
        self.client = client
        self.dead_until = 0.0
        self.refusals = 0         # failures not timeouts: a probe revives only if none since
        self.probing = False      # a probe is asking it whether it is only slow
        # when probes found it only slow, within the last retry_after
        self.revivals: collections.deque[float] = collections.deque()


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
        for entry in names:  # once now, so the first reads find the servers
            self._resolve(entry)
        self._publish()
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
        """Count a server's failure and skip it for `retry_after` seconds; a
        timeout also starts a probe that brings it back at once if it answers
        (busy, not dead), unless probes did so `REVIVALS` times in the last
        `retry_after`."""
        counters.add("cluster_errors")
        now = time.monotonic()
        retry = self.cfg.retry_after
        with self._lock:
            timed_out = getattr(exc, "timed_out", False)
            server.refusals += not timed_out
            while server.revivals and now - server.revivals[0] > retry:
                server.revivals.popleft()
            probe = (timed_out and not server.probing
                     and len(server.revivals) < REVIVALS and not self._closed.is_set())
            server.probing = server.probing or probe
            if server.dead_until <= now:
                log.warning("memcached %s failed (%s: %s); skipping it %s", server.name,
                            type(exc).__name__, exc, "while a probe asks whether it is only "
                            "slow" if probe else f"for {retry:.3g}s")
            server.dead_until = now + retry
        if probe:
            threading.Thread(target=self._probe, args=(server, server.refusals),
                             name="blockcache-tier-probe", daemon=True).start()

    def _probe(self, server: Server, refusals: int) -> None:
        """Ask a server that timed out for `version`, waiting up to
        `retry_after`: one that answers was only slow and is used again
        (unless it refused or reset meanwhile: more timeouts of requests
        already in flight say nothing new); a stalled one stays skipped."""
        answered = server.client.answers(self.cfg.retry_after)
        with self._lock:
            server.probing = False
            if answered and server.refusals == refusals and not self._closed.is_set():
                server.dead_until = 0.0
                server.revivals.append(time.monotonic())
                log.info("memcached %s answers a probe: slow, not dead; using it again",
                         server.name)

    # -- requests (never raise for a server's failure) ----------------------------

    def get_into(self, blocks: dict[str, dict[str, int]], place: Place, counters: Counters,
                 landed: Callable[[str], None] | None = None,
                 bad: Callable[[str, Exception], None] | None = None) -> set[str]:
        """Read the items of several blocks ({block key: {item name: its
        size}}) where `place` says, calling `landed` as each is in
        (`Memcache.get_into`): one multi-get per server that holds some. The
        names read whole; a failing server's are missing. `bad(block key,
        error)` hears of an item of the wrong size (poison stored there, or
        a hostile server) before the server is skipped, so it can be deleted."""
        by_server: dict[Server, dict[str, int]] = {}
        owners: dict[str, str] = {}  # item name -> its block key
        for block_key, sizes in blocks.items():
            server = self.owner(block_key)
            if server is not None:
                by_server.setdefault(server, {}).update(sizes)
                owners.update(dict.fromkeys(sizes, block_key))
        found: set[str] = set()
        for server, sizes in by_server.items():
            try:
                found.update(server.client.get_into(sizes, place, landed))
            except Refused as exc:  # our request, not the server: no skipping
                log.debug("memcached %s refused a get: %s", server.name, exc)
                counters.add("cluster_errors")
            except ServerFailed as exc:
                if exc.bad_item is not None and bad is not None:
                    bad(owners[exc.bad_item], exc)
                self.failed(server, exc, counters)
        return found

    def delete(self, block_key: str, names: Iterable[str], counters: Counters) -> None:
        """Remove a bad block's items (all of them: a later fill stores it anew)."""
        server = self.owner(block_key)
        if server is None:
            return
        try:
            server.client.delete_many(names)
        except Refused as exc:
            log.debug("memcached %s refused a delete: %s", server.name, exc)
        except ServerFailed as exc:
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
        try:
            # The copy whose first item is stored owns the block: `add` it, and
            # the rest only if it went in. Another host's copy (or its fill
            # under way) stays whole; slices of two copies never mix.
            (first, head), *rest = items
            if not server.client.add(first, head):
                return
            for name, value in rest:
                server.client.set(name, value)
        except Refused as exc:  # out of memory, too large: this fill, not the server
            log.debug("memcached %s refused a fill of %s: %s", server.name, block_key, exc)
            counters.add("cluster_fills_dropped")
            return
        except ServerFailed as exc:
            self.failed(server, exc, counters)
            counters.add("cluster_fills_dropped")
            return
        counters.add("cluster_fills_sent")

    # -- membership ----------------------------------------------------------------

    def _set_addresses(self, entry: str, host: str, addresses: list[tuple[str, int]]) -> None:
        names = []
        for addr, port in addresses:
            name = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
            names.append(name)
            if name not in self._servers:
                # TLS checks the configured name, not the address it resolved to
                client = Memcache((addr, port), self.cfg.connect_timeout, self.cfg.timeout,
                                  self._tls_context, server_name=host)
                self._servers[name] = Server(name, client)
        self._by_entry[entry] = names

    def _dns_loop(self, entries: list[str]) -> None:
        while not self._closed.wait(self.cfg.dns_refresh):
            for entry in entries:
                if self._resolve(entry):
                    with self._lock:
                        self._publish()

    def _resolve(self, entry: str) -> bool:
        """Set a DNS entry's servers to all the addresses its name has now;
        False (the last answer kept) if it cannot be resolved."""
        host, port = parse_server(entry)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("memcached %s: cannot resolve %s (%s); keeping %d address(es)",
                        entry, host, exc, len(self._by_entry.get(entry, ())))
            return False
        self._set_addresses(entry, host, sorted({(i[4][0], port) for i in infos}))
        return True

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
