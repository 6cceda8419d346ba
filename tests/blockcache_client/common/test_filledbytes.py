"""FilledBytes: bytes stored through views become the result without a copy,
and a view still alive makes it copy rather than change under its holder."""

import tracemalloc

from blockcache_client.common.filledbytes import FilledBytes, release

N = 4 << 20


def test_the_bytes_stored_are_handed_over_without_a_copy():
    pieces = [bytes([i]) * (1 << 20) for i in range(4)]
    tracemalloc.start()
    try:
        whole = FilledBytes(N)
        for i, piece in enumerate(pieces):
            part = whole.view[i << 20:(i + 1) << 20]
            part[:] = piece
            release(part)
        got = whole.value()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert type(got) is bytes and len(got) == N
    assert [got[i << 20] for i in range(4)] == [0, 1, 2, 3]
    assert peak < 1.2 * N  # the buffer itself became the result


def test_a_view_left_alive_gets_a_copy_not_the_result():
    whole = FilledBytes(16)
    kept = whole.view[:4]
    kept[:] = b"abcd"
    got = whole.value()
    kept[:] = b"wxyz"  # its holder may still write: the result does not change
    assert got == b"abcd" + bytes(12)
    release(None)  # nothing to let go of
