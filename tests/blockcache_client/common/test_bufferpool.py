"""`BufferPool`: a buffer is handed out again only once no view of it is alive."""

from __future__ import annotations

import mmap

from blockcache_client.common.bufferpool import BufferPool, unused


def _writer(data: bytes):
    def readinto(view: memoryview) -> int:
        n = min(len(view), len(data))
        view[:n] = data[:n]
        return n
    return readinto


def test_a_buffer_comes_back_only_when_its_last_view_is_gone():
    pool = BufferPool(16, limit=64)
    block = pool.fill(16, _writer(b"a" * 16))
    assert bytes(block) == b"a" * 16 and block.readonly
    piece = block[4:8]                       # a slice holds the buffer too
    del block
    other = pool.fill(16, _writer(b"b" * 16))
    assert bytes(piece) == b"aaaa"           # not overwritten while a view lives
    assert pool.reused == 0
    del piece, other
    again = pool.fill(16, _writer(b"c" * 16))
    assert pool.reused == 1 and bytes(again) == b"c" * 16


def test_the_pool_keeps_at_most_its_limit_and_still_hands_out_buffers():
    pool = BufferPool(16, limit=32)
    held = [pool.fill(16, _writer(bytes([i]) * 16)) for i in range(5)]
    assert pool.kept_bytes == 32             # two kept, three of their own
    assert [bytes(v) for v in held] == [bytes([i]) * 16 for i in range(5)]
    del held
    pool.fill(16, _writer(b"x" * 16))
    assert pool.reused == 1 and pool.kept_bytes == 32


def test_a_short_read_is_a_shorter_view():
    pool = BufferPool(16, limit=64)
    view = pool.fill(16, _writer(b"end"))
    assert bytes(view) == b"end" and len(view) == 3



def test_a_taken_buffer_is_held_from_the_moment_take_returns():
    # a thread between `take` and making its first view must not lose its
    # buffer to another thread's `take`: the view comes from under the lock
    pool = BufferPool(16, limit=64)
    pool.take()  # kept, and free again at once
    first = pool.take()
    assert pool.reused == 1
    second = pool.take()
    assert second.obj is not first.obj
    assert not unused(first.obj)


def test_populated_buffers_come_back_only_when_their_last_view_is_gone():
    # a cold read's fresh buffers are mappings with their pages, not
    # bytearrays: a view still blocks their reuse, and they start zeroed
    size = 1 << 20
    pool = BufferPool(size, limit=2 * size, populate=True)
    block = pool.fill(size, _writer(b"a" * size))
    assert isinstance(block.obj, mmap.mmap) and block.readonly
    piece = block[4:8]
    del block
    other = pool.take()
    assert not any(other[:size])             # a second, fresh buffer
    other[:4] = b"bbbb"
    assert bytes(piece) == b"aaaa"           # not overwritten while a view lives
    assert pool.reused == 0 and not unused(piece.obj)
    del piece, other
    again = pool.fill(3, _writer(b"ccc"))
    assert pool.reused == 1 and bytes(again) == b"ccc"
    assert pool.kept_bytes == 2 * size
