"""A hostile memcached (or someone in its place: TLS is optional) costs a
read a bounded time and memory, and never its bytes: values trickling in,
endless `VALUE` lines, huge and absurd declared lengths, and whatever else
a server may send. A real daemon names the fake server in `hello`."""

from __future__ import annotations

import os
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockcache_client.cluster.items import SLICE_HEAD_SIZE, Geometry
from tests.support.fake_memcached import (
    FakeMemcached,
    declared,
    endless_values,
    slow_value,
    value_line,
)
from tests.support.remote_files import random_files

SIZE = 300_000  # a block of one slice
ITEM = SLICE_HEAD_SIZE + Geometry(SIZE, 64 << 10).body_len(0)
# a read's worst case: the fixture's 100 ms timeout plus the item at
# MIN_RATE (~0.2 s), then the remote; generous for a loaded 2-core machine.
# Unbounded, the trickle alone takes hours.
READ_BOUND = 3.0
MEMORY_BOUND = 32 << 20
EXAMPLES = 40  # allocated at once by a read; the huge length asks 2 GB

HOSTILE = {
    "slow value": slow_value(ITEM),               # 1 byte per 40 ms
    "endless VALUE lines": endless_values(ITEM),
    "huge length": declared(2_000_000_000),
    "absurd length": declared(2 ** 50),
}


@pytest.fixture
def fake():
    server = FakeMemcached(lambda names: [b"END\r\n"])
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("hostile", HOSTILE)
def test_a_hostile_server_costs_a_read_bounded_time_and_memory(cluster, key_file, tmp_path,
                                                               fake, hostile):
    root = tmp_path / "remote"
    root.mkdir()
    files = random_files(root, 3, SIZE)
    fake.answer = HOSTILE[hostile]
    # retry_after 1 ms: every read meets the hostile server again
    v = cluster.volume(cluster.host([fake.address], retry_after="1ms"), str(root), key_file)
    for rel, data in files.items():
        tracemalloc.start()
        try:
            t = time.monotonic()
            assert v.read(rel, 0, SIZE) == data
            took = time.monotonic() - t
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert took < READ_BOUND, (rel, took)
        assert peak < MEMORY_BOUND, (rel, peak)
    assert fake.gets >= len(files)
    s = v.stats()
    assert s["cluster_errors"] >= len(files) and s["cluster_hits"] == 0
    assert s["backend_bytes"] == len(files) * SIZE


# pieces of an answer, rendered with the names asked and the sizes they must have
_SIZES = st.sampled_from(["right", "short", "long", "zero", "huge", "absurd", "negative",
                          "word"])
_PIECES = st.lists(st.one_of(
    st.tuples(st.just("value"), st.integers(0, 2), _SIZES),
    st.tuples(st.just("payload"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("bytes"), st.binary(max_size=80)),
    st.just(("end",)),
    st.just(("crlf",)),
    st.tuples(st.just("sleep"), st.floats(0, 0.15)),
), max_size=8)


def _render(pieces, names: list[str], geo: Geometry) -> list[bytes | float]:
    def right(i: int) -> int:
        name = names[min(i, len(names) - 1)]
        return SLICE_HEAD_SIZE + geo.body_len(int(name.rsplit(":", 1)[1]))

    out: list[bytes | float] = []
    for kind, *args in pieces:
        if kind == "value":
            i, size = args
            n = right(i)
            declared_size = {"right": n, "short": n - 1, "long": n + 1, "zero": 0,
                             "huge": 2_000_000_000, "absurd": 2 ** 50, "negative": -n,
                             "word": "many"}[size]
            out.append(value_line(names[min(i, len(names) - 1)], declared_size))
        elif kind == "payload":
            i, whole = args
            out.append(os.urandom(right(i) if whole else right(i) // 2) + b"\r\n")
        elif kind == "bytes":
            out.append(args[0])
        elif kind == "end":
            out.append(b"END\r\n")
        elif kind == "crlf":
            out.append(b"\r\n")
        else:
            out.append(args[0])
    return out


def test_whatever_a_server_sends_a_read_returns_the_right_bytes(cluster, key_file, tmp_path,
                                                               fake):
    root = tmp_path / "remote"
    root.mkdir()
    # a block of one slice read whole, or of two read inside its second slice
    # (a range read: only that slice is asked for); a new file each time: a
    # miss everywhere but the tier
    shapes = {100_000: (0, 100_000), 600_000: (500_000, 4096)}
    files = {size: iter(random_files(root, EXAMPLES, size, f"s{size}-").items()) for size in shapes}
    v = cluster.volume(cluster.host([fake.address], retry_after="1ms"), str(root), key_file)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    @given(_PIECES, st.sampled_from(sorted(shapes)))
    def check(pieces, size):
        off, n = shapes[size]
        rel, data = next(files[size])
        geo = Geometry(size, 64 << 10)
        fake.answer = lambda names: _render(pieces, names, geo)
        t = time.monotonic()
        assert v.read(rel, off, n) == data[off:off + n]
        assert time.monotonic() - t < READ_BOUND

    check()
    assert fake.gets >= EXAMPLES * 3 // 4  # a read during a probe may skip it
    assert v.stats()["cluster_hits"] == 0
