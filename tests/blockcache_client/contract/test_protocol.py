"""Wire protocol: frame codec, limits, argument checks."""

import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockcache_client.contract import protocol, wire
from blockcache_client.contract.errors import ProtocolError
from blockcache_client.contract.protocol import MAX_BATCH, MAX_FRAME, ErrorCode

values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=50)
    | st.binary(max_size=50) | st.floats(allow_nan=False),
    lambda inner: (st.lists(inner, max_size=5)
                   | st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=20)


@given(st.dictionaries(st.text(max_size=10), values, max_size=8))
def test_frame_round_trip(body):
    frame = protocol.encode_frame(body)
    n = protocol.frame_length(frame[:4])
    assert n == len(frame) - 4
    assert protocol.decode_body(frame[4:]) == body


def test_frame_length_limits():
    with pytest.raises(ProtocolError) as e:
        protocol.frame_length(struct.pack(">I", 0))
    assert e.value.code == ErrorCode.BAD_FRAME
    with pytest.raises(ProtocolError) as e:
        protocol.frame_length(struct.pack(">I", MAX_FRAME + 1))
    assert e.value.code == ErrorCode.FRAME_TOO_LARGE
    assert protocol.frame_length(struct.pack(">I", MAX_FRAME)) == MAX_FRAME


def test_encode_refuses_oversized():
    with pytest.raises(ProtocolError) as e:
        protocol.encode_frame({"id": 1, "op": "put", "data": bytes(MAX_FRAME)})
    assert e.value.code == ErrorCode.FRAME_TOO_LARGE


def test_largest_block_fits_a_frame():
    from blockcache_client.contract.blockfile import MAX_PLAINTEXT, BlockHeader
    h = BlockHeader(b"\0" * 8, b"\0" * 16, MAX_PLAINTEXT, 64 << 10)
    frame = protocol.encode_frame({"id": 2**32 - 1, "op": "put", "key": "v" * 63 + "_" * 60,
                                   "data": bytes(h.file_size)})
    assert len(frame) - 4 <= MAX_FRAME


@pytest.mark.parametrize("data", [b"\xc1", b"\x92\x01", b"\xa5abc", b"\x81\x01\x02", b"\xd9"])
def test_garbage_is_bad_frame(data):
    with pytest.raises(ProtocolError) as e:
        protocol.decode_body(data)
    assert e.value.code == ErrorCode.BAD_FRAME


@pytest.mark.parametrize("obj", [[1, 2], 5, "x", None])
def test_body_must_be_map(obj):
    with pytest.raises(ProtocolError) as e:
        protocol.decode_body(msgpack.packb(obj))
    assert e.value.code == ErrorCode.BAD_FRAME


def test_unpack_bounds_size():
    data = msgpack.packb({"a": "x" * 100})
    with pytest.raises(ProtocolError) as e:
        wire.unpack(data, 50)
    assert e.value.code == ErrorCode.FRAME_TOO_LARGE
    # a container header claiming more entries than the frame could hold
    with pytest.raises(ProtocolError):
        wire.unpack(b"\xdd\xff\xff\xff\xff", 64)
    with pytest.raises(ProtocolError):
        wire.unpack(b"\xc7\x01\x05x", 64)  # ext types are refused


@pytest.mark.parametrize("rid", [None, 0, -1, 2**32, True, "1", 1.0])
def test_request_id_checked(rid):
    with pytest.raises(ProtocolError) as e:
        protocol.request_id({"id": rid})
    assert e.value.code == ErrorCode.BAD_REQUEST


def test_args_typed():
    body = {"op": "lookup", "keys": ["a"], "n": 3, "flag": True}
    assert protocol.arg(body, "n", int) == 3
    assert protocol.arg(body, "x", int, required=False, default=9) == 9
    with pytest.raises(ProtocolError):
        protocol.arg(body, "flag", int)  # bool is not an int on the wire
    with pytest.raises(ProtocolError):
        protocol.arg(body, "x", int)
    assert protocol.key_list(body) == ["a"]
    with pytest.raises(ProtocolError):
        protocol.key_list({"keys": ["a"] * (MAX_BATCH + 1)})
    with pytest.raises(ProtocolError):
        protocol.key_list({"keys": [b"a"]})
    with pytest.raises(ProtocolError):
        protocol.key_list({"keys": "abc"})


def test_reply_shapes():
    assert protocol.ok(3, paths=[None]) == {"id": 3, "ok": True, "paths": [None]}
    assert protocol.error(4, ErrorCode.UNKNOWN_OP, "no") == \
        {"id": 4, "ok": False, "code": "unknown_op", "message": "no"}


def _ping_holding(value: bytes) -> bytes:
    """A ping whose extra field `x` is the msgpack `value` given."""
    return b"\x83" + msgpack.packb({"id": 1, "op": "ping"})[1:] + b"\xa1x" + value


def _arrays_of_empty_arrays(size: int) -> bytes:
    """About `size` bytes of arrays of 4,095 empty arrays each: within the
    length cap, one byte of msgpack and a Python object of ~80 each."""
    inner = b"\xdc" + (4095).to_bytes(2, "big") + b"\x90" * 4095
    k = size // len(inner)
    return b"\xdc" + k.to_bytes(2, "big") + inner * k


@pytest.mark.parametrize("frame", [
    _ping_holding(b"\xdd" + (MAX_FRAME - 40).to_bytes(4, "big") + b"\x90" * (MAX_FRAME - 40)),
    _ping_holding(_arrays_of_empty_arrays(protocol.SHAPED_MAX - 100)),
    _ping_holding(_arrays_of_empty_arrays(60_000)),
], ids=["17 MiB of empty arrays", "1 MiB nested", "60 KB nested"])
def test_a_request_of_many_containers_is_refused_as_it_is_decoded(frame):
    """Decoded as msgpack would, each frame costs seconds and 80x its size
    (17 MiB: 1.3 GB); refused, it costs nothing."""
    for views in (False, True):
        with pytest.raises(ProtocolError) as bad:
            protocol.decode_request(memoryview(frame), views)
        assert bad.value.code == ErrorCode.BAD_FRAME


def test_every_request_shape_still_decodes():
    longest = "v" * 63 + "_" + "9" * 19 + "_" + "a" * 32 + "_" + "0" * 16
    lookup = msgpack.packb({"id": 1, "op": "lookup", "keys": [longest] * MAX_BATCH})
    assert 500_000 < len(lookup) < protocol.SHAPED_MAX
    assert protocol.decode_request(lookup, True)["keys"] == [longest] * MAX_BATCH
    touch = msgpack.packb({"id": 2, "op": "touch", "keys": [longest] * MAX_BATCH,
                           "cluster": {"volume": "v", "counters": {"cluster_hits": 3}}})
    assert protocol.decode_request(touch)["cluster"]["counters"] == {"cluster_hits": 3}
    block = bytes(MAX_FRAME - 200)
    put = wire.pack({"id": 3, "op": "put", "key": longest, "data": block})
    assert protocol.decode_request(memoryview(put), True)["data"] == block
    with pytest.raises(ProtocolError, match="longer|exceeds|4096"):
        protocol.decode_request(msgpack.packb({"id": 4, "op": "lookup",
                                               "keys": ["k"] * (MAX_BATCH + 1)}))
