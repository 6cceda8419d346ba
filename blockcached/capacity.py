"""Capacity rules for one cache dir: how much may be stored, when to evict.

Three limits, the smallest wins:
- the configured size (`capacity`): the hard limit, never exceeded;
- the free-space floor: after the last statvfs, our usage may grow only by
  what the file system has free beyond `min_free_bytes` (and likewise for
  inodes beyond `min_free_inodes`), so the cache never fills the disk;
- (globally, in `cache`) `max_entries`.

Bytes count as used from the moment a put is admitted (`reserved`) until the
eviction that frees them, so concurrent puts cannot overshoot: admission
happens on the event loop, one put at a time. When a put would cross the high
watermark of the effective limit, just enough blocks leave to keep it there
(the policy picks them, or refuses the put), so a full dir stays within a
block of its high watermark instead of idling a quarter of its disk after a
batch. Only a dir found above its high watermark (the free-space floor moved,
a rebuild found more than fits) is trimmed down to the low one.
"""

from __future__ import annotations

from dataclasses import dataclass

UNLIMITED = 1 << 62


@dataclass(slots=True)
class DirCapacity:
    capacity: int
    high: float
    low: float
    min_free_bytes: int
    min_free_inodes: int
    reserved: int = 0            # admitted puts not yet written
    reserved_entries: int = 0
    fs_byte_limit: int = UNLIMITED   # usage allowed by the free-space floor
    fs_entry_limit: int = UNLIMITED  # entries allowed by the free-inode floor
    free_bytes: int = -1             # from the last statvfs (-1: not yet known)
    free_inodes: int = -1

    def observe(self, used: int, entries: int, free_bytes: int, free_inodes: int) -> None:
        """Record a statvfs taken while the dir held `used` bytes in `entries` files."""
        self.free_bytes, self.free_inodes = free_bytes, free_inodes
        self.fs_byte_limit = used + self.reserved + max(0, free_bytes - self.min_free_bytes)
        self.fs_entry_limit = (entries + self.reserved_entries
                               + max(0, free_inodes - self.min_free_inodes))

    def byte_limit(self) -> int:
        return min(self.capacity, self.fs_byte_limit)

    def need_bytes(self, used: int, size: int) -> int:
        """Bytes to evict before admitting `size` more (0 = none): what would
        cross the high watermark."""
        after = used + self.reserved + size
        return max(0, after - int(self.high * self.byte_limit()))

    def trim_bytes(self, used: int) -> int:
        """Bytes to evict from a dir found above its high watermark: down to the low one."""
        limit = self.byte_limit()
        after = used + self.reserved
        if after <= self.high * limit:
            return 0
        return max(0, after - int(self.low * limit))

    def need_entries(self, entries: int, count: int = 1) -> int:
        after = entries + self.reserved_entries + count
        if self.fs_entry_limit >= UNLIMITED or after <= self.high * self.fs_entry_limit:
            return 0
        return max(0, after - int(self.low * self.fs_entry_limit))

    def fits(self, used: int, entries: int, size: int) -> bool:
        """Whether `size` more bytes in one more file stay within every hard limit."""
        return (used + self.reserved + size <= self.byte_limit()
                and entries + self.reserved_entries + 1 <= self.fs_entry_limit)

    def reserve(self, size: int) -> None:
        self.reserved += size
        self.reserved_entries += 1

    def release(self, size: int) -> None:
        self.reserved -= size
        self.reserved_entries -= 1
