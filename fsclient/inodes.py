"""The inode table: the inodes the kernel knows, mapped back to their paths.

Inode numbers are `Volume.inode(path)`: stable keyed hashes of the path, the
same numbers the reader puts in block keys, on every host with the volume key
and every restart. An
entry is added by a successful lookup or readdirplus entry and dropped when
`forget` brings its lookup count to zero, so the table follows the kernel's
own inode cache; `pruner.NodePruner` keeps that under the mount's
`max_nodes` by asking the kernel to forget the least recently looked-up
nodes, taken from the front of the table (a lookup moves its node to the
back). A node with open handles stays until their release (its open count
guards the page-cache store) and is never asked for. Every worker thread
uses it: the counts change under one lock, held for a few dict operations.

A rename on a writable mount moves a node: the kernel keeps its id for the
new name, so the node names the new path (`moved`; `_moved` maps it back
to the id). If the old path is looked up again (DCP writes `.metadata.tmp`
anew after renaming the last one), its id is answered with the next
generation (`gen`): the kernel then takes the id for a new inode and marks
the moved one bad (its dentry is looked up again, by its own id), so one id
never names two files at once. The moved node's lookups stay counted in
the id, whose forgets may come from either inode.

Under a keeper (`keeper.keeper`), every node's path and lookup count are
also kept in the mount's saved state (`keeper.saved`): the count raised
before the kernel learns of the lookup, lowered after its forget. A server
that took the connection over starts with the root alone and finds any other
id the kernel sends there, with its count; the saved state drops a path once
its count is zero, the kernel holding no such id.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from blockcache_client import Volume

from .keeper.saved import SavedState
from .session import ROOT_ID, FuseError

log = logging.getLogger(__name__)

ROOT_INODE = ROOT_ID


class Node:
    """An inode the kernel knows: its path, kernel lookup count, the size the
    kernel was last told (attributes of a lookup, getattr or readdirplus
    reply), how many handles of it are open, and its generation: raised by
    each new version or size the kernel is told of (see `pagestore`), and the
    handle tag of its last open (see `handles.OpenFiles.open`)."""

    __slots__ = ("path", "lookups", "size", "opens", "generation", "tag", "gen", "moved")

    def __init__(self, path: str, lookups: int, gen: int = 0):
        self.path = path
        self.lookups = lookups
        self.size = -1
        self.opens = 0
        self.generation = 0
        self.tag: tuple[object, int] | None = None  # (FileInfo, its file_tag)
        self.gen = gen  # the id's incarnation the kernel was told (see `moved`)
        self.moved = False  # renamed: its id is another path's hash


class InodeTable:
    """inode -> Node for the inodes the kernel holds, the root always."""

    __slots__ = ("_nodes", "_volume", "_lock", "saved", "recovered", "resized", "grew", "peak",
                 "_moved")

    def __init__(self, volume: Volume, saved: SavedState | None = None):
        # in order of last lookup, the least recent first (the pruner's victims)
        self._nodes: dict[int, Node] = {ROOT_INODE: Node("", 1)}
        self._volume = volume
        self._lock = threading.Lock()
        self.saved = saved  # the keeper's record of every node's path
        self.recovered = 0  # nodes found in the saved state, not by a lookup
        # called (inode, node) when the size the kernel is told changes, before
        # it is told, outside the table's lock (the page store's generation)
        self.resized: Callable[[int, Node], None] | None = None
        self.grew: Callable[[int], None] | None = None  # called with `held()` after an add
        self.peak = 1  # the most nodes held at once
        self._moved: dict[str, int] = {}  # path -> the id of the node renamed to it

    def held(self) -> int:
        """Nodes the kernel holds, as far as this server knows: the table's,
        or the saved state's when it names more (nodes from before a takeover
        that this server has not met yet)."""
        saved = len(self.saved.paths) if self.saved is not None else 0
        return max(len(self._nodes), saved)

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
            return self._recover(inode)
        return node

    def _recover(self, inode: int) -> Node:
        """A node the kernel holds from before this server (or forgot here
        first), found in the saved state; ESTALE for an id never handed out."""
        path = self.saved.paths.get(inode) if self.saved is not None else None
        if path is None:
            raise FuseError(errno.ESTALE)
        with self._lock:
            node = self._nodes.get(inode)
            if node is None:
                node = self._nodes[inode] = Node(path, self.saved.lookups(inode))
                self.recovered += 1
                if self.inode_of(path) != inode:  # renamed under the server before
                    node.moved = True
                    self._moved[path] = inode
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
        if node is not None and node.path != path and not node.moved:
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
        added = False
        with self._lock:
            node = self._nodes.get(inode)
            if node is not None and node.path != path and node.moved:
                node = self._reincarnate(inode, node, path)
            if node is not None and node.path != path:
                node = None
            else:  # (the saved count is raised before the kernel can send the id)
                lookups = self.saved.looked_up(inode, path) if self.saved is not None else 0
                if node is None:
                    node = self._nodes[inode] = Node(path, lookups or 1)
                    added = True
                else:
                    node.lookups = lookups or node.lookups + 1
                    self._nodes[inode] = self._nodes.pop(inode)  # (the most recent now)
            if node is not None:
                old, node.size = node.size, size
        if added:
            held = self.held()
            self.peak = max(self.peak, held)
            if self.grew is not None:
                self.grew(held)
        if node is not None:
            if 0 <= old != size and self.resized is not None:
                self.resized(inode, node)
            return inode
        self.shown(inode, path)  # (logs the collision)
        return None

    def gen_of(self, inode: int, path: str) -> int:
        """The generation a lookup of `path` answers with its id `inode`."""
        node = self._nodes.get(inode)
        if node is None:
            return 0
        return node.gen + 1 if node.moved and node.path != path else node.gen

    def _reincarnate(self, inode: int, moved: Node, path: str) -> Node:
        """`path` looked up again while its id names the node renamed away
        (see the module doc): a node of the next generation, holding the
        moved one's lookups (under the table's lock)."""
        if self._moved.get(moved.path) == inode:
            del self._moved[moved.path]
        node = self._nodes[inode] = Node(path, moved.lookups, moved.gen + 1)
        node.opens = moved.opens
        if self.saved is not None:
            self.saved.moved(inode, path)
        return node

    def moved(self, src: str, dst: str) -> None:
        """The kernel renamed `src` to `dst` (a writable mount): the node it
        holds for `src`, if any, names `dst` from now on."""
        with self._lock:
            inode = self._moved.pop(src, None) or self.inode_of(src)
            node = self._nodes.get(inode)
            if node is None or node.path != src:
                return
            node.path = dst
            node.moved = self.inode_of(dst) != inode
            if node.moved:
                self._moved[dst] = inode
            if self.saved is not None:
                self.saved.moved(inode, dst)

    def set_size(self, inode: int, node: Node, size: int) -> None:
        """`size` is what the kernel is told next about `node` (a getattr)."""
        old, node.size = node.size, size
        if 0 <= old != size and self.resized is not None:
            self.resized(inode, node)

    def forget(self, inode_list: Iterable[tuple[int, int]]) -> None:
        with self._lock:
            for inode, nlookup in inode_list:
                if inode == ROOT_INODE:
                    continue
                left = self.saved.forgot(inode, nlookup) if self.saved is not None else None
                node = self._nodes.get(inode)
                if node is None:
                    continue
                node.lookups = node.lookups - nlookup if left is None else left
                if node.lookups <= 0 and node.opens <= 0:  # (an open node goes at its release)
                    self._drop(inode, node)

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
                self._drop(inode, node)

    def _drop(self, inode: int, node: Node) -> None:
        """(Under the lock.)"""
        del self._nodes[inode]
        if node.moved and self._moved.get(node.path) == inode:
            del self._moved[node.path]

    def least_recent(self, n: int) -> list[tuple[int, str]]:
        """Up to `n` (inode, path) of the nodes looked up least recently that
        the kernel may forget: not the root, not open. Each is moved to the
        back, so a node the kernel keeps anyway (a process's cwd, an mmap) is
        not asked for again in the next round. Nodes the saved state names
        from before a takeover, not met here yet, come first."""
        out: list[tuple[int, str]] = []
        saved = self.saved
        with self._lock:
            if saved is not None and len(saved.paths) > len(self._nodes):
                for inode, path in list(saved.paths.items()):
                    if len(out) >= n:
                        break
                    if inode not in self._nodes and inode != ROOT_INODE:
                        out.append((inode, path))
            for inode in list(self._nodes):
                if len(out) >= n:
                    break
                node = self._nodes[inode]
                if inode == ROOT_INODE or node.opens > 0 or node.lookups <= 0:
                    continue
                out.append((inode, node.path))
                self._nodes[inode] = self._nodes.pop(inode)
        return out
