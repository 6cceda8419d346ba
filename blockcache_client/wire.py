"""The one msgpack wrapper: fixed options, size limits on anything we unpack.

Everything read from a socket goes through `unpack`, which bounds every
container and string by the frame it came in, so a hostile peer cannot make
us allocate more than one frame's worth (msgpack's C unpacker also bounds
nesting depth and raises for overly deep input).
"""

import threading
from typing import Any

import msgpack

from .errors import ProtocolError

# One reusable Packer per thread: `msgpack.packb` builds (and frees) a Packer
# with its buffer on every call, a third of the cost of packing a small
# request. A Packer is not thread-safe, hence per thread; it resets its
# buffer itself when packing fails.
_local = threading.local()


def pack(obj: Any) -> bytes:
    try:
        packer = _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)


def unpack(data: bytes | memoryview, max_size: int) -> Any:
    """Unpack one msgpack object of at most `max_size` bytes; ProtocolError if bad."""
    if len(data) > max_size:
        raise ProtocolError("frame_too_large", f"message of {len(data)} bytes exceeds {max_size}")
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_str_len=max_size, max_bin_len=max_size,
            max_array_len=max_size, max_map_len=max_size, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError("bad_frame", f"frame is not valid msgpack: {exc}") from None
