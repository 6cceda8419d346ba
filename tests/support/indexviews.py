"""Views of a daemon `Index` that only tests need: where a key is, its
size, a dir's LRU order, and popping a dir's least recently used entries
(the daemon itself peeks victims and evicts them through the cache)."""

from __future__ import annotations

from blockcached.index import Index


def dir_of(index: Index, key: str) -> int:
    """Index of the dir holding `key`, or -1."""
    for i, d in enumerate(index.dirs):
        if key in d.lru:
            return i
    return -1


def size_of(index: Index, key: str) -> int | None:
    for d in index.dirs:
        v = d.lru.get(key)
        if v is not None:
            return v >> 32
    return None


def lru_order(index: Index, dir_index: int) -> list[str]:
    """Keys of one dir, least recently used first."""
    return list(index.dirs[dir_index].lru)


def pop_lru(index: Index, dir_index: int, free_bytes: int,
            free_entries: int = 0) -> list[tuple[str, int]]:
    """Remove least recently used entries of one dir until at least
    `free_bytes` bytes and `free_entries` entries are freed (or the dir is
    empty); returns (key, size) of each."""
    victims = index.peek_lru(dir_index, free_bytes, free_entries)
    for key, _ in victims:
        index.remove(key)
    return victims
