"""Reading a byte range as block-sized parts, each part its own bytes."""

from __future__ import annotations

from collections.abc import Callable


def read_parts(read: Callable[[int, int], bytes], start: int, end: int,
               piece: int) -> list[bytes]:
    """Bytes [start, end) as `piece`-byte parts (the last shorter), where
    `read(n, pos)` returns up to `n` bytes at `pos` (b"" at the end of the
    data). Each part is read straight into its own bytes, so a coalesced read
    is split without a second copy; a short read inside a part is finished;
    fewer bytes only where the data ends."""
    parts = []
    pos = start
    while pos < end:
        want = min(piece, end - pos)
        got = read(want, pos)
        while got and len(got) < want:  # a short read inside the data: finish the part
            more = read(want - len(got), pos + len(got))
            if not more:
                break
            got += more
        if not got:
            break
        parts.append(got)
        pos += len(got)
        if len(got) < want:
            break
    return parts


def split_parts(data: bytes, piece: int) -> list[bytes]:
    """`data` as `piece`-byte parts (the last shorter): itself if it fits one."""
    if len(data) <= piece:
        return [data]
    view = memoryview(data)
    return [bytes(view[o:o + piece]) for o in range(0, len(data), piece)]
