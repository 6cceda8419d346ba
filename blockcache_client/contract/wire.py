"""The one msgpack wrapper: fixed options, size limits on anything we unpack.

Everything read from a socket goes through `unpack`, which bounds every
container and string by the frame it came in (msgpack's C unpacker also
bounds nesting depth and raises for overly deep input). That alone still
lets a frame cost far more than its size: each empty array or map is one
byte of msgpack and a Python object of 80 (17 MiB of them: 1.3 GB and 10 s).
So a caller that decodes what anyone may send (the daemon) also caps the
length of each container (`max_len`) and how many containers a frame may
hold (`max_containers`, counted as msgpack builds them: decoding stops at
the first one over), which bounds the objects a frame makes by a constant,
whatever its size.
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


def _packer() -> msgpack.Packer:
    """This thread's packer (a Packer is not thread-safe)."""
    try:
        return _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
        return packer


def pack(obj: Any) -> bytes:
    return _packer().pack(obj)


class _TooManyContainers(Exception):
    pass


def _counter(limit: int):
    """A msgpack hook that passes containers through and raises past `limit`."""
    left = limit

    def hook(obj):
        nonlocal left
        left -= 1
        if left < 0:
            raise _TooManyContainers
        return obj

    return hook


def unpack(data: bytes | memoryview, max_size: int, max_len: int | None = None,
           max_containers: int | None = None) -> Any:
    """Unpack one msgpack object of at most `max_size` bytes, its arrays and
    maps of at most `max_len` entries (default: `max_size`), and at most
    `max_containers` of them in all (default: no limit); ProtocolError if bad."""
    if len(data) > max_size:
        raise ProtocolError("frame_too_large", f"message of {len(data)} bytes exceeds {max_size}")
    max_len = max_size if max_len is None else max_len
    hooks = {}
    if max_containers is not None:
        hooks["list_hook"] = hooks["object_hook"] = _counter(max_containers)
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_str_len=max_size, max_bin_len=max_size,
            max_array_len=max_len, max_map_len=max_len, max_ext_len=0, **hooks,
        )
    except _TooManyContainers:
        raise ProtocolError("bad_frame", f"frame holds more than {max_containers} arrays "
                                         f"and maps") from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError("bad_frame", f"frame is not valid msgpack: {exc}") from None


# -- large messages without copying their payload -------------------------------
#
# A put carries a block file (up to 16 MiB) as one bin value. Packing it with
# msgpack copies it twice (into the packer, out as bytes) and unpacking copies
# it once more; at this size each copy of fresh memory costs about as much as
# the socket transfer itself. So a flat map (scalar keys and values, the shape
# of every request) is packed around its big bin values, which are sent as they
# are, and unpacked into memoryviews of the frame. The bytes on the wire are
# exactly msgpack's: smallest headers, keys in the map's order.

# first byte -> size of scalars of fixed size: nil, false, true, float 32/64,
# uint 8..64, int 8..64
_FIXED = {0xc0: 1, 0xc2: 1, 0xc3: 1, 0xca: 5, 0xcb: 9, 0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9,
          0xd0: 2, 0xd1: 3, 0xd2: 5, 0xd3: 9}
# first byte -> bytes of the length that follows it: bin 8/16/32, str 8/16/32
_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}
_BIN = (0xc4, 0xc5, 0xc6)
_BUFFERS = (bytes, bytearray, memoryview)


def bin_header(n: int) -> bytes:
    """msgpack's header of a bin value of `n` bytes (the smallest form)."""
    if n < 1 << 8:
        return bytes((0xc4, n))
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def pack_parts(obj: dict[str, Any], min_view: int) -> list[bytes | memoryview]:
    """`pack(obj)` as a list of parts whose concatenation it is, with each bin
    value of at least `min_view` bytes a part of its own, not copied (for a
    gathering send). Other values are packed as `pack` packs them."""
    for value in obj.values():
        if isinstance(value, _BUFFERS) and len(value) >= min_view:
            break
    else:
        return [pack(obj)]  # the common case: a small request, one part
    packer = _packer()
    parts: list[bytes | memoryview] = []
    head = [packer.pack_map_header(len(obj))]
    for key, value in obj.items():
        head.append(packer.pack(key))
        if isinstance(value, _BUFFERS) and len(value) >= min_view:
            view = memoryview(value).cast("B")
            head.append(bin_header(len(view)))
            parts += (b"".join(head), view)
            head = []
        else:
            head.append(packer.pack(value))
    if head:
        parts.append(b"".join(head))
    return parts


def _scalar_end(data: memoryview, pos: int) -> int:
    """Offset just past the scalar msgpack object at `pos`; -1 if it is not
    a scalar (a container, an ext, or not msgpack)."""
    b = data[pos]
    if b < 0x80 or b >= 0xe0:                  # positive / negative fixint
        return pos + 1
    if 0xa0 <= b < 0xc0:                       # fixstr
        return pos + 1 + (b & 0x1f)
    size = _FIXED.get(b)
    if size is not None:
        return pos + size
    width = _SIZED.get(b)
    if width is None:
        return -1
    return pos + 1 + width + int.from_bytes(data[pos + 1:pos + 1 + width], "big")


# Requests are maps of a handful of keys. This decoder walks a map in Python,
# an entry at a time: a frame announcing millions of entries would hold the
# daemon's event loop for seconds (a 17 MiB map of 8.9 M entries: 11 s here,
# 0.4 s in msgpack's C `unpack`), so a longer map goes to `unpack`.
VIEW_MAX_ENTRIES = 16


def unpack_views(data: memoryview, max_size: int, min_view: int) -> dict[Any, Any] | None:
    """`unpack(data, max_size)` for a flat map, except that each bin value of
    at least `min_view` bytes comes back as a memoryview of `data` instead of
    a copy. None if `data` is not a whole flat map of at most
    `VIEW_MAX_ENTRIES` entries (a container or ext value, truncated, trailing
    bytes, too many entries): `unpack` then decodes it, or names the error."""
    if len(data) > max_size:
        raise ProtocolError("frame_too_large", f"message of {len(data)} bytes exceeds {max_size}")
    end = len(data)
    if not end:
        return None
    b = data[0]
    if 0x80 <= b < 0x90:
        count, pos = b & 0x0f, 1
    elif b in (0xde, 0xdf):
        width = 2 if b == 0xde else 4
        count, pos = int.from_bytes(data[1:1 + width], "big"), 1 + width
    else:
        return None
    if count > VIEW_MAX_ENTRIES:
        return None
    out: dict[Any, Any] = {}
    key: Any = None
    for i in range(2 * count):
        if pos >= end:
            return None
        stop = _scalar_end(data, pos)
        if not pos < stop <= end:
            return None
        if i % 2 == 0:
            key = unpack(data[pos:stop], max_size)
            if not isinstance(key, (str, bytes)):  # msgpack's strict_map_key
                raise ProtocolError("bad_frame", f"frame is not valid msgpack: "
                                                 f"{type(key).__name__} is not allowed for map key")
        elif data[pos] in _BIN and stop - (start := pos + 1 + _SIZED[data[pos]]) >= min_view:
            out[key] = data[start:stop]
        else:
            out[key] = unpack(data[pos:stop], max_size)
        pos = stop
    return out if pos == end else None
