"""Page-aligned read buffers (`common.aligned`), and the pool's aligned views."""

import ctypes

from blockcache_client.common.aligned import PAGE, aligned
from blockcache_client.common.bufferpool import BufferPool


def _addr(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_aligned_views_start_on_a_page_and_are_zeroed():
    for size in (1, 4096, 100_000, 1 << 20):
        v = aligned(size)
        assert len(v) == size and _addr(v) % PAGE == 0
        assert not any(v)


def test_the_pool_hands_out_page_aligned_views_and_reuses_a_buffer_only_once_free():
    pool = BufferPool(1 << 20, 4 << 20, page_aligned=True)
    a = pool.take()
    assert len(a) == 1 << 20 and _addr(a) % PAGE == 0
    a[:5] = b"hello"
    b = pool.take()  # `a` still referred to: another buffer
    assert _addr(b) != _addr(a) and bytes(a[:5]) == b"hello"
    where = _addr(a)
    del a
    c = pool.take()
    assert _addr(c) in (where, _addr(b)) and pool.reused == 1 and _addr(c) % PAGE == 0
