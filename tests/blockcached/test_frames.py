"""Large frames without copies: the wire codec's pieces and views (what the
daemon's large-frame path decodes with), and the server's frame buffer pool."""

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockcache_client.contract import protocol, wire
from blockcache_client.contract.errors import ProtocolError
from blockcache_client.contract.protocol import VIEW_MIN, ErrorCode
from blockcached import buffers
from blockcached.buffers import FRAME_CLASS, FramePool

# bin lengths at every msgpack header boundary and at the view threshold
BIN_SIZES = [0, 1, 255, 256, 65535, 65536, 65537, VIEW_MIN - 1, VIEW_MIN, VIEW_MIN + 1, 1 << 20]

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=40)
           | st.binary(max_size=40) | st.floats(allow_nan=False))


def _plain(body):
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in body.items()}


@pytest.mark.parametrize("size", BIN_SIZES)
def test_parts_are_the_frame_and_big_bins_come_back_as_views(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    body = {"id": 2**32 - 1, "op": "put", "key": "vol_1_x", "data": data, "after": -1}
    frame = protocol.encode_frame(body)
    parts = protocol.frame_parts(body)
    assert b"".join(parts) == frame
    # the block itself is a part of its own, not a copy
    assert any(isinstance(p, memoryview) and p.obj is data for p in parts) == (size >= VIEW_MIN)
    got = protocol.decode_body(memoryview(frame)[4:], views=True)
    assert _plain(got) == body
    assert isinstance(got["data"], memoryview if size >= VIEW_MIN else bytes)


# big bins built, not drawn byte by byte (drawing 64 KiB is slow)
big_bins = st.builds(lambda n, b: bytes([b]) * n, st.integers(VIEW_MIN - 2, VIEW_MIN + 2),
                     st.integers(0, 255))


@given(st.dictionaries(st.text(max_size=10), scalars | big_bins, max_size=20))
def test_views_decode_every_flat_map_as_unpack_does(body):
    frame = protocol.encode_frame(body)
    assert b"".join(protocol.frame_parts(body)) == frame
    assert _plain(protocol.decode_body(frame[4:], views=True)) == protocol.decode_body(frame[4:])


@given(st.dictionaries(st.text(max_size=5), st.lists(scalars, max_size=3)
                       | st.dictionaries(st.text(max_size=3), scalars, max_size=3),
                       min_size=1, max_size=4))
def test_nested_maps_fall_back_to_unpack(body):
    frame = protocol.encode_frame(body)
    assert protocol.decode_body(frame[4:], views=True) == body


def test_a_map_of_many_entries_is_left_to_unpack():
    """A frame announcing millions of tiny entries must not be walked entry by
    entry in Python on the event loop: the view decoder declines it, and the C
    decoder answers (with a copy of the big bin, the only cost)."""
    body = {f"k{i}": 0 for i in range(wire.VIEW_MAX_ENTRIES + 1)}
    body["data"] = bytes(VIEW_MIN)
    packed = msgpack.packb(body, use_bin_type=True)
    assert wire.unpack_views(memoryview(packed), protocol.MAX_FRAME, VIEW_MIN) is None
    assert protocol.decode_body(packed, views=True) == body
    ok = dict(list(body.items())[-wire.VIEW_MAX_ENTRIES:])
    got = wire.unpack_views(memoryview(msgpack.packb(ok, use_bin_type=True)),
                            protocol.MAX_FRAME, VIEW_MIN)
    assert isinstance(got["data"], memoryview)  # at the bound: still views


big = msgpack.packb({"id": 1, "data": bytes(VIEW_MIN)}, use_bin_type=True)


@pytest.mark.parametrize("data", [
    b"\xc1", b"\x92\x01", b"\xa5abc", b"\x81\x01\x02", b"\xd9",
    big[:-1],                                  # truncated inside the big bin
    big + b"\x00",                             # trailing bytes
    b"\x81\x01" + big[big.index(b"\xc6"):],     # an int key before a big bin
    b"\x81\xa1k\xa2\xff\xfe",                  # a str that is not UTF-8
    b"\x81\xa1k\xc7\x01\x01\x00",              # an ext value
])
def test_garbage_is_bad_frame_with_views_too(data):
    with pytest.raises(ProtocolError) as e:
        protocol.decode_body(data, views=True)
    assert e.value.code == ErrorCode.BAD_FRAME


def test_pool_reuses_a_buffer_only_once_no_view_of_it_is_alive():
    pool = FramePool(limit=4 * FRAME_CLASS)
    a = pool.take(FRAME_CLASS + 1)
    assert len(a) == 2 * FRAME_CLASS
    block = memoryview(a)[10:20]            # a put's block, queued for writing
    b = pool.take(FRAME_CLASS + 5)
    assert b is not a
    nested = memoryview(b)[:100][5:7]       # a view of a view holds it too
    fresh = pool.take(2 * FRAME_CLASS)      # beyond the limit: handed out, not kept
    assert fresh is not a and fresh is not b
    assert [id(x) for x in pool.buffers] == [id(a), id(b)]
    del block
    assert pool.take(2 * FRAME_CLASS - 3) is a
    del nested
    got = pool.take(2 * FRAME_CLASS)
    assert got is a or got is b
    assert pool.size == 4 * FRAME_CLASS and len(a) == len(b) == 2 * FRAME_CLASS


def test_pool_finds_a_buffer_freed_in_put_order_without_scanning_the_busy(monkeypatch):
    # puts outrunning the disk: every buffer queued, the writes ending in order
    pool = FramePool(limit=100 * FRAME_CLASS)
    held = [memoryview(pool.take(FRAME_CLASS))[:1] for _ in range(100)]
    checks = 0
    real = buffers._unused

    def counted(buf):
        nonlocal checks
        checks += 1
        return real(buf)

    monkeypatch.setattr(buffers, "_unused", counted)
    for i in range(300):
        freed = held[i % 100]
        held[i % 100] = None
        freed.release()
        del freed
        got = pool.take(FRAME_CLASS)
        held[i % 100] = memoryview(got)[:1]
    assert len(pool.buffers) == 100
    assert checks <= 2 * 300  # (a scan from the start: ~50 checks a take)


def test_pool_gives_way_to_a_new_size_and_stays_within_its_limit():
    pool = FramePool(limit=4 * FRAME_CLASS)
    pool.take(FRAME_CLASS)
    pool.take(2 * FRAME_CLASS)
    c = pool.take(3 * FRAME_CLASS)          # no room: an unused buffer is dropped for it
    assert pool.size <= 4 * FRAME_CLASS and any(x is c for x in pool.buffers)
    assert pool.take(3 * FRAME_CLASS) is c


def test_trim_lets_go_of_unused_buffers_only():
    pool = FramePool(limit=8 * FRAME_CLASS)
    held = pool.take(FRAME_CLASS)
    block = memoryview(held)[:10]           # still queued for writing
    pool.take(2 * FRAME_CLASS)
    pool.trim()
    assert [id(b) for b in pool.buffers] == [id(held)] and pool.size == FRAME_CLASS
    del block
    pool.trim()
    assert pool.buffers == [] and pool.size == 0
