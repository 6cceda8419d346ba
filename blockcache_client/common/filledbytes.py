"""A bytes object filled in place: where a read of many blocks lands.

A `read` of many blocks returns one bytes object. Built as a bytes object
per block and then joined, every byte was copied twice into fresh memory,
where a first touch costs a page fault per 4 KiB (~0.9 ms a MiB on a VM),
and the peak held twice the read. Here the bytes are stored once, through
writable views of a `BytesIO`'s buffer, and `value()` hands that buffer
over as the result: CPython's `getvalue()` copies only a buffer still
exported (a view of it alive) or shared. So every view given out must be
released first (`release`); one that cannot be (exported further) makes
`value()` copy: right, just slower.
"""

from __future__ import annotations

import io


class FilledBytes:
    """`n` bytes (n > 0), zero until stored through `view`."""

    __slots__ = ("_io", "view")

    def __init__(self, n: int):
        self._io = io.BytesIO()
        self._io.seek(n - 1)
        self._io.write(b"\0")
        self.view = self._io.getbuffer()  # slices of it: `release` each once stored

    def value(self) -> bytes:
        """The bytes stored, without a copy if no view of them is left."""
        release(self.view)
        return self._io.getvalue()


def release(view: memoryview | None) -> None:
    """Let go of `view`'s hold on its buffer (one exported further keeps it)."""
    try:
        if view is not None:
            view.release()
    except BufferError:
        pass
