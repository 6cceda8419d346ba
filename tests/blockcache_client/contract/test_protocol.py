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
