"""Read buffers placed so the kernel's copy into them runs at full speed.

Why: on AMD Zen (the EPYC VMs this runs on) the kernel copies file pages to
user memory with `rep movsb`, which runs about six times slower when the
destination lies 1 to 31 bytes past the source modulo 4 KiB (4K aliasing).
malloc puts a large bytearray's bytes 16 bytes into a page, so a pread of
a cache file at a page-aligned offset into one cost ~550 us a MiB where
~90 is right. `aligned` gives a buffer whose view starts on a page: a pread
at file offset `off` into `buf[off % PAGE:]` then has source and
destination at the same place in their pages, the fast case.
(`python -m bench.large_files` and `bench.fio` show the effect.)
"""

from __future__ import annotations

import ctypes

PAGE = 4096


def aligned(size: int) -> memoryview:
    """A zeroed (so already faulted in) writable view of `size` bytes that
    starts on a page boundary."""
    return page_view(bytearray(size + PAGE), size)


def page_view(raw: bytearray, size: int) -> memoryview:
    """A view of `size` bytes of `raw` (`size` + PAGE long) that starts on a
    page boundary. A whole page written from it is one copy for the kernel,
    not two (the FUSE reply of a read lands in page-cache pages)."""
    k = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % PAGE
    return memoryview(raw)[k:k + size]
