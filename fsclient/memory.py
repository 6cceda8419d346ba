"""What bounds a server's memory, term by term (fsclient/DESIGN.md, "Memory
is bounded"), and what it uses now: `fsclient status` shows both.

Every term is a setting times what one unit of it costs, measured here
(CPython 3.12, x86-64; tracemalloc over 50,000 nodes and 100,000 cached
files, paths of 28 bytes):
- a node: 305 bytes in the table and the saved state's maps, plus its path
  (49 + its length): NODE_BYTES allows paths of about 150 bytes;
- a metadata cache entry: a file in a cached listing and in the attribute
  cache (572 bytes, the FileInfo shared), or, worst, an attribute entry and a
  listing entry of different FileInfos (552 + 392), plus its open version
  and a quarter of a negative entry: CACHE_ENTRY_BYTES;
- the saved state's memfd, charged to the same memory cgroup (shmem):
  `pruner.saved_cap`;
- block memory: the reader's LRU (`memory_cache_bytes`) and its buffer pool,
  which keeps up to twice that in idle buffers (docs/reader.md);
- reply buffers: 8 MiB kept, plus 1 MiB for each read that finds none free,
  at most one per worker and per wait handed off (`session.workers.MAX_WAITING`);
- background fills in flight, `fill_queue_bytes`;
- a writable mount's uploads: the uploader's part buffers (`upload_parallel`
  parts of `upload_part_bytes` and a sealed unit each, shared by every
  upload: `writer.upload`), plus a small file's one PUT; and each file open
  for writing holds `writer.stagedfile.KEPT_UNITS` units of plaintext and
  two sealed units (`STAGED_FILE_BYTES`): a term per file, counted at 8.
BASE_BYTES is the interpreter, the modules and an open volume: 40 MiB at
start here, with room for another libc or Python build.
"""

from __future__ import annotations

import os

from blockcache_client.contract import blockfile
from blockcache_client.writer.stagedfile import KEPT_UNITS, UNIT
from blockcache_client.writer.upload import DEFAULT_PARALLEL, DEFAULT_PART_BYTES

from .config import MountConfig
from .handles import REPLY_BYTES, REPLY_BYTES_KEPT
from .pruner import saved_cap
from .session.workers import MAX_WAITING

BASE_BYTES = 48 << 20
NODE_BYTES = 512
CACHE_ENTRY_BYTES = 1280
# A mount's other processes: its keeper (31 MiB measured) and the page
# store's child (16 MiB measured)
MOUNT_PROCESSES_BYTES = 48 << 20
# A file open for writing: its units in memory, a seal buffer and a scratch unit
STAGED_FILE_BYTES = KEPT_UNITS * UNIT + 2 * blockfile.file_size(UNIT, blockfile.DEFAULT_CHUNK)
STAGED_FILES_COUNTED = 8  # files open for writing at once the bound allows for


def bound(cfg: MountConfig) -> dict[str, int]:
    """The most bytes a server of `cfg` holds, by what holds them; "total" sums them."""
    terms = {
        "base": BASE_BYTES,
        "nodes": cfg.max_nodes * NODE_BYTES,
        "saved_state": saved_cap(cfg.max_nodes),
        "metadata_caches": cfg.meta_cache_entries * CACHE_ENTRY_BYTES,
        "block_memory": 3 * cfg.memory_cache_bytes,
        "reply_buffers": REPLY_BYTES_KEPT + (MAX_WAITING + cfg.threads) * REPLY_BYTES,
        "fill_queue": cfg.fill_queue_bytes,
    }
    if cfg.writable:
        stride = blockfile.file_size(UNIT, blockfile.DEFAULT_CHUNK)
        terms["uploads"] = DEFAULT_PARALLEL * (DEFAULT_PART_BYTES + stride) + DEFAULT_PART_BYTES
        terms["staged_files"] = STAGED_FILES_COUNTED * STAGED_FILE_BYTES
    terms["total"] = sum(terms.values())
    return terms


def mount_bound(cfg: MountConfig) -> int:
    """The most bytes one mount of `cfg` holds: its server, keeper and page
    store (what a CSI node plugin's memory limit is built on)."""
    return bound(cfg)["total"] + MOUNT_PROCESSES_BYTES


def rss_bytes() -> int:
    """This process's resident memory (/proc/self/statm), 0 if unknown."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
