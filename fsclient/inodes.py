"""The inode table: the inodes the kernel knows, mapped back to their paths.

Inode numbers are `Volume.inode(path)`: stable keyed hashes of the path, the
same numbers the reader puts in block keys, on every host with the volume key
and every restart. An
entry is added by a successful lookup or readdirplus entry and dropped when
`forget` brings its lookup count to zero, so the table is bounded by the
kernel's own inode cache. A node with open handles stays until their release
(its open count guards the page-cache store). Every worker thread uses it: the
counts change under one lock, held for a few dict operations.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterable, Iterator

from blockcache_client import Volume

from .session import ROOT_ID, FuseError

log = logging.getLogger(__name__)

ROOT_INODE = ROOT_ID


class Node:
    """An inode the kernel knows: its path, kernel lookup count, the size the
    kernel was last told (attributes of a lookup, getattr or readdirplus
    reply) and how many handles of it are open."""

    __slots__ = ("path", "lookups", "size", "opens")

    def __init__(self, path: str, lookups: int):
        self.path = path
        self.lookups = lookups
        self.size = -1
        self.opens = 0


class InodeTable:
    """inode -> Node for the inodes the kernel holds, the root always."""

    __slots__ = ("_nodes", "_volume", "_lock")

    def __init__(self, volume: Volume):
        self._nodes: dict[int, Node] = {ROOT_INODE: Node("", 1)}
        self._volume = volume
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, inode: int) -> bool:
        return inode in self._nodes

    def __getitem__(self, inode: int) -> Node:
        return self._nodes[inode]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._nodes))

    def get(self, inode: int) -> Node | None:
        return self._nodes.get(inode)

    def node(self, inode: int) -> Node:
        node = self._nodes.get(inode)
        if node is None:
            # The kernel asked about an inode it forgot: never expected, but an
            # errno is better than a crash.
            raise FuseError(errno.ESTALE)
        return node

    def path(self, inode: int) -> str:
        return self.node(inode).path

    def inode_of(self, path: str) -> int:
        """`Volume.inode(path)` of a path built here from normalized parts
        (a known path and a name from the kernel or a listing): the same
        number without normalizing the path again. A name normalize would
        refuse (a NUL byte) still goes through it, and raises as it should."""
        if "\0" in path:
            return self._volume.inode(path)
        return self._volume.names.inode(path)

    def shown(self, inode: int, path: str) -> bool:
        """False if `inode` is another path's (an inode-hash collision): that
        path is then hidden, and the collision logged."""
        node = self._nodes.get(inode)
        if node is not None and node.path != path:
            log.error("inode collision: %r and %r both hash to inode %d; %r is hidden",
                      node.path, path, inode, path)
            return False
        return True

    def remember(self, path: str, size: int, inode: int | None = None) -> int | None:
        """Inode of `path` (or `inode`, already computed), with its kernel
        lookup count raised by one and `size` noted as the size the kernel
        now has; None on an inode-hash collision (the entry is then not shown)."""
        if inode is None:
            inode = self.inode_of(path)
        with self._lock:
            node = self._nodes.get(inode)
            if node is None:
                node = self._nodes[inode] = Node(path, 1)
            elif node.path != path:
                node = None
            else:
                node.lookups += 1
            if node is not None:
                node.size = size
                return inode
        self.shown(inode, path)  # (logs the collision)
        return None

    def forget(self, inode_list: Iterable[tuple[int, int]]) -> None:
        with self._lock:
            for inode, nlookup in inode_list:
                node = self._nodes.get(inode)
                if node is None or inode == ROOT_INODE:
                    continue
                node.lookups -= nlookup
                if node.lookups <= 0 and node.opens <= 0:  # (an open node goes at its release)
                    del self._nodes[inode]

    def opened(self, node: Node) -> int:
        """One more handle of `node` is open: the count of its open handles."""
        with self._lock:
            node.opens += 1
            return node.opens

    def closed(self, inode: int, node: Node) -> None:
        """One handle of `node` was released: drop it if the kernel forgot it
        while it was open."""
        with self._lock:
            node.opens -= 1
            if node.opens <= 0 and node.lookups <= 0 and self._nodes.get(inode) is node:
                del self._nodes[inode]
