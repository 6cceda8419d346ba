"""A volume's background link to `blockcached`: layout, touches, fills, evictions.

Readers never wait on this module. It owns two threads per process:

- control (here): connects (`hello` -> `Layout` + `layout_epoch`),
  reconnects with jittered exponential backoff while the daemon is down, and
  every `touch_interval` seconds (or as soon as `touch_batch` keys are
  waiting) sends the recorded accesses as batched `touch`es; with nothing to
  report it `ping`s, so a dead daemon or a new `layout_epoch` is noticed
  within about one interval. While it is not connected `layout` is None and
  every read goes to the backend.
- filler (`fillqueue`, which `DaemonLink` extends): seals and puts the
  blocks readers offer, and the evictions of bad ones, in order, on a
  connection of its own.

Its `leases` (`leases.Leases`) are the fetch leases readers take and wait
for, on connections of their own, while the link is connected to a daemon
that grants them (`hello`'s `lease_timeout`).

Invariants: nothing here raises into a reader. Fork: a child must build a
new link (the threads and sockets of the parent's do not work there);
`Volume` does that.
"""

from __future__ import annotations

import logging
import os
import random
import threading

from ..common.counters import CLUSTER_COUNTERS, Counters
from ..contract.cluster import ClusterConfig
from ..contract.errors import BlockcacheError, DaemonError, DaemonUnavailable, UntrustedPeer
from ..contract.layout import Layout
from ..contract.protocol import MAX_BATCH, ErrorCode
from .client import Client
from .fillqueue import CALL_TIMEOUT, FillQueue, Seal
from .leases import Leases

log = logging.getLogger(__name__)

_BACKOFF_MIN = 0.05
_BACKOFF_MAX = 5.0


class DaemonLink(FillQueue):
    """Background connection of one volume in one process to the daemon."""

    def __init__(self, socket_path: str, counters: Counters,
                 seal: Seal,
                 fill_queue_bytes: int, touch_interval: float = 0.5, touch_batch: int = 1024,
                 client_name: str = "blockcache_client", daemon_uid: int | None = None,
                 volume: str | None = None, area_slot_bytes: int = 0):
        super().__init__(socket_path, counters, seal, fill_queue_bytes,
                         lambda: self.layout is not None, daemon_uid, area_slot_bytes)
        self._pid = os.getpid()
        self.layout: Layout | None = None
        self.layout_epoch: int | None = None
        # the uid that owns the block files: hello's, else the peer's (SO_PEERCRED)
        self.daemon_uid: int | None = None
        self.cluster: ClusterConfig | None = None  # hello's memcached pool, if any
        self._warned = ""  # the last untrusted peer or version refusal warned about
        self._touch_interval = touch_interval
        self._touch_batch = min(touch_batch, MAX_BATCH)
        self._client_name = client_name
        self._volume = volume  # whose cluster counters the pings and touches report
        self._reported = dict.fromkeys(CLUSTER_COUNTERS, 0)  # what the daemon has
        self._control = Client(socket_path, timeout=CALL_TIMEOUT, daemon_uid=daemon_uid)
        self.leases = Leases(socket_path, counters, lambda: self.layout is not None, daemon_uid)
        self._wake = threading.Event()
        # a set: FUSE reads a 4 MiB block 128 KiB at a time; one report per batch is enough
        self._touches: set[str] = set()
        self._touch_lock = threading.Lock()
        # bumped as each batch is taken: a key touched in this round need not be again
        self.touch_round = 0
        try:  # connect now, so the first reads can already use the cache
            self._connect()
        except (DaemonUnavailable, DaemonError, ValueError, KeyError) as exc:
            log.debug("blockcached at %s not reachable yet: %s", socket_path, exc)
        control = threading.Thread(target=self._control_loop, name="blockcache-link",
                                   daemon=True)
        control.start()
        self._threads = [control, self._start_filler()]

    # -- called by readers (never block, never raise) --------------------------

    @property
    def connected(self) -> bool:
        return self.layout is not None

    def touch(self, key: str) -> None:
        """Record an access; sent later in a batch."""
        with self._touch_lock:
            self._touches.add(key)
            full = len(self._touches) >= self._touch_batch
        if full:
            self._wake.set()

    def evict_inode(self, volume: str, inode: int) -> int:
        """Synchronously evict every cached block of one file; DaemonUnavailable if down."""
        return self._control.evict(inode=(volume, inode))

    def close(self, timeout: float = 1.0) -> None:
        """Flush what can be flushed quickly, then stop the threads."""
        if self._closed.is_set() or self._pid != os.getpid():
            # in a forked child this link's threads do not exist and its locks
            # may be held forever by them: touch nothing
            return
        with self._fill_cv:  # fills offered from now on are dropped, not sent
            self._closing = True
        self.wait_idle(timeout)
        self._closed.set()
        self._wake.set()
        with self._fill_cv:
            self._fill_cv.notify_all()
            self._idle_cv.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._control.close()
        self._filler_client.close()
        self.leases.close()

    # -- control thread --------------------------------------------------------

    def _connect(self) -> None:
        reply = self._control.hello(self._client_name)
        self.layout_epoch = reply.get("layout_epoch")
        uid = reply.get("uid", self._control.peer_uid)
        self.daemon_uid = uid if isinstance(uid, int) and not isinstance(uid, bool) else None
        self.cluster = ClusterConfig.from_wire(reply.get("cluster"))
        if self.cluster is None and reply.get("cluster") is not None:
            log.warning("blockcached at %s names a cluster tier this reader cannot use (%r); "
                        "reading without it", self.socket_path, reply.get("cluster"))
        timeout = reply.get("lease_timeout")
        self.leases.timeout = (float(timeout) if isinstance(timeout, (int, float))
                               and not isinstance(timeout, bool) and 0 < timeout < 3600 else 0.0)
        self.layout = Layout.from_wire(reply["layout"])
        log.info("connected to blockcached at %s (layout epoch %s, %d dir(s))",
                 self.socket_path, self.layout_epoch, len(self.layout.dirs))

    def _disconnect(self, why: object) -> None:
        if self.layout is not None:
            log.warning("lost blockcached at %s: %s; reading from the backend until it "
                        "returns", self.socket_path, why)
        self.layout = None
        self._control.close()

    def _control_loop(self) -> None:
        backoff = _BACKOFF_MIN
        while not self._closed.is_set():
            if self.layout is None:
                try:
                    self._connect()
                    backoff = _BACKOFF_MIN
                except (DaemonUnavailable, DaemonError, ValueError, KeyError) as exc:
                    self._disconnect(exc)
                    if _needs_an_operator(exc) and str(exc) != self._warned:
                        self._warned = str(exc)  # once, not at every retry
                        log.warning("%s", exc if isinstance(exc, UntrustedPeer) else
                                    f"blockcached at {self.socket_path}: {exc}")
                    log.debug("blockcached at %s unavailable: %s", self.socket_path, exc)
                    self._closed.wait(random.uniform(backoff / 2, backoff))
                    backoff = min(_BACKOFF_MAX, backoff * 2)
                    continue
            self._wake.wait(self._touch_interval)
            self._wake.clear()
            self._nudge_filler()
            try:
                self._report()
            except DaemonError as exc:
                # an error reply (busy, ...): the daemon is there and the layout
                # still holds; these touches are lost, LRU order barely notices
                log.debug("blockcached refused a touch/ping: %s", exc)
            except (DaemonUnavailable, ValueError, KeyError) as exc:
                self._disconnect(exc)
        try:
            self._report()  # last touches on close, best effort
        except BlockcacheError:
            pass

    def _report(self) -> None:
        with self._touch_lock:
            keys, self._touches = list(self._touches), set()
            self.touch_round += 1
        if self.layout is None:
            return
        epoch = None
        now, cluster = self._cluster_report()
        if not keys:
            epoch = self._control.ping(cluster).get("layout_epoch")
        for i in range(0, len(keys), MAX_BATCH):
            epoch = self._control.touch(keys[i:i + MAX_BATCH],
                                        cluster if i == 0 else None).get("layout_epoch")
        self._reported = now  # delivered: the next report starts from here
        if epoch is not None and epoch != self.layout_epoch:
            log.info("blockcached layout epoch %s -> %s; fetching the new layout",
                     self.layout_epoch, epoch)
            self._connect()

    def _cluster_report(self) -> tuple[dict[str, int], dict | None]:
        """(the cluster counters now, the report of their growth since the
        last delivered one, or None if nothing grew)."""
        snap = self._counters.snapshot()
        now = {k: snap[k] for k in CLUSTER_COUNTERS}
        grown = {k: v - self._reported[k] for k, v in now.items() if v != self._reported[k]}
        if not grown or self._volume is None:
            return self._reported, None
        return now, {"volume": self._volume, "counters": grown}


def _needs_an_operator(exc: Exception) -> bool:
    """A refusal that retrying will not mend: an untrusted peer, or a daemon
    of another protocol version."""
    return isinstance(exc, UntrustedPeer) or (
        isinstance(exc, DaemonError) and exc.code == ErrorCode.UNSUPPORTED_VERSION)
