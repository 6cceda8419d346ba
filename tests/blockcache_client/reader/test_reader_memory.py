"""The shared LRU of blocks and chunks (`reader/memory`, `reader/chunks`) and the table of open
block files (`reader/blockfds`): their bounds hold whatever the sequence."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockcache_client.reader.hits.blockfds import BlockFiles
from blockcache_client.reader.hits.chunks import UNSEALED, ChunkCache
from blockcache_client.reader.hits.memory import PIECE_OVERHEAD, BlockMemory

CAP = 1000
OVERHEAD = 16  # a small piece overhead, so the budget sees it in sequences of tiny pieces
keys = st.sampled_from([f"v_{i}_{j:016x}" for i in range(3) for j in range(4)])
ops = st.one_of(
    st.tuples(st.just("block"), keys, st.integers(0, 1200), st.booleans()),
    st.tuples(st.just("chunk"), keys, st.integers(0, 300), st.integers(0, 3)),
    st.tuples(st.just("bind"), keys, st.just(0), st.booleans()),
    st.tuples(st.just("discard"), st.sampled_from(["v_0_", "v_1_", "v_"]), st.just(0),
              st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=60))
def test_budget_and_accounting_hold_for_any_sequence(seq):
    mem = BlockMemory(CAP, piece_overhead=OVERHEAD)
    blocks: dict[str, bytes] = {}
    for op, key, size, arg in seq:
        if op == "block":
            data = os.urandom(size)
            mem.put(key, data, transient=arg)
            blocks[key] = data
        elif op == "chunk":
            mem.put((key, b"head", arg), bytes(size))
        elif op == "bind":
            held, _ = mem.get_bound(key)
            bound = mem.bind_head(key, blocks.get(key, b"x") if arg else b"other", b"H")
            assert bound == (arg and held is not None and held is blocks.get(key))
        else:
            mem.discard_prefix(key)
        entries = dict(mem._blocks)
        assert mem.used <= CAP
        pieces = sum(len(v) + OVERHEAD for k, v in entries.items() if type(k) is tuple)
        assert mem.chunk_bytes == pieces
        assert mem.used == pieces + sum(len(v) for k, v in entries.items() if type(k) is str)
        # a binding and a transient mark only ever name a block held now
        assert set(mem._heads) <= set(entries) and set(mem._transient) <= set(entries)
        for k, head in mem._heads.items():
            data, bound = mem.get_bound(k)
            assert bound == head and data is entries[k]


def test_transient_blocks_go_first_and_chunks_stay():
    mem = BlockMemory(10, piece_overhead=0)
    mem.put(("a", b"h", 0), b"12")
    mem.put(("a", b"h", 1), b"34")
    mem.put("b1", b"xxx", transient=True)
    mem.put("b2", b"yyy", transient=True)  # full: nothing dropped yet (10 bytes)
    mem.put("b3", b"zzz", transient=True)  # b1 goes, not the older chunks
    assert mem.get("b1") is None and mem.get(("a", b"h", 0)) == b"12"
    mem.put("w", b"wwwww")  # a window's block: the transient ones go first
    assert mem.get("b2") is None and mem.get("b3") is None
    assert mem.get(("a", b"h", 1)) == b"34" and mem.used <= 10
    mem.put("b4", b"qqq", transient=True)  # no room but chunks and w: not kept
    assert mem.get("b4") is None and mem.get(("a", b"h", 1)) == b"34" and mem.used <= 10
    mem.put("b5", b"q", transient=True)  # free room: kept
    assert mem.get("b5") == b"q"


def test_a_file_held_by_a_read_is_closed_when_given_back(tmp_path):
    paths = [tmp_path / f"b{i}" for i in range(3)]
    for p in paths:
        p.write_bytes(b"block")
    files = BlockFiles(limit=1)
    owner: set[str] = set()
    first = files.adopt("k0", os.open(paths[0], os.O_RDONLY), b"h", 5, owner)
    # the bound pushes k0 out while a read still uses it: it stays open
    files.give_back(files.adopt("k1", os.open(paths[1], os.O_RDONLY), b"h", 5, owner))
    assert len(files) == 1 and os.pread(first.fd, 5, 0) == b"block"
    files.give_back(first)
    assert first.closed
    # unlinked (evicted, or replaced by rename): noticed, closed, not lent
    os.unlink(paths[1])
    assert files.borrow("k1", owner) is None and len(files) == 0
    ent = files.adopt("k2", os.open(paths[2], os.O_RDONLY), b"h", 5, owner)
    files.give_back(ent)
    files.disown(owner)
    assert ent.closed and len(files) == 0 and not owner


@pytest.mark.parametrize("lo,hi,start,stop", [(5000, 5100, 4096, 8192),
                                               (70000, 70000 + (80 << 10), 65536, 196608)],
                         ids=["page", "run"])
def test_pieces_read_before_the_seal_are_kept_only_for_the_same_bytes(lo, hi, start, stop):
    """A small read keeps the page it touched, a larger one its run of
    chunks: both wait under UNSEALED and are kept under the real header only
    if the block sealed holds exactly their bytes."""
    chunk = 64 << 10
    mem = BlockMemory(1 << 20)
    chunks = ChunkCache(mem, chunk)
    old, new = os.urandom(4 * chunk), os.urandom(4 * chunk)
    piece = old[start:stop]

    def under(head):
        return ("k", head, start, stop)
    chunks.saw("k", old, None, lo, hi)  # read before the seal: waits
    assert mem.get(under(UNSEALED)) == piece and mem.get(under(b"H")) is None
    # a page of a 100-byte read, not its whole chunk; and what keeping it costs
    assert mem.chunk_bytes == len(piece) + mem.piece_overhead
    chunks.sealed("k", new, b"H")  # other bytes sealed under this key: not kept
    assert mem.get(under(b"H")) is None and mem.chunk_bytes == 0
    chunks.saw("k", old, None, lo, hi)
    chunks.sealed("k", old, b"H2")
    assert mem.get(under(b"H2")) == piece and mem.chunk_bytes == len(piece) + mem.piece_overhead


def test_pages_are_charged_their_bookkeeping():
    """4 KiB pages cost more than their bytes (key, LRU node, object
    header): the budget counts it, so a budget full of pages holds fewer."""
    mem = BlockMemory(1 << 20)
    for i in range(1000):
        mem.put(("k", b"h", i * 4096, (i + 1) * 4096), bytes(4096))
    assert mem.used <= 1 << 20
    assert len(mem._blocks) == (1 << 20) // (4096 + PIECE_OVERHEAD) < 256


@pytest.mark.parametrize("soft,limit", [(20000, 1024), (1024, 256), (40, 10)])
def test_block_files_kept_open_leave_most_of_the_open_files_limit(monkeypatch, soft, limit):
    from blockcache_client.reader.hits import blockfds
    monkeypatch.setattr(blockfds.resource, "getrlimit", lambda what: (soft, 1 << 20))
    assert BlockFiles().limit == limit


def test_two_adjacent_reads_are_not_yet_a_stream():
    """Random reads at aligned offsets meet by chance: the second of two in
    a row keeps its pieces; the third is a stream and keeps none."""
    chunks = ChunkCache(BlockMemory(1 << 20), 64 << 10)
    blen, n = 4 << 20, 128 << 10
    assert chunks.wants("k", blen, 0, n)
    assert chunks.wants("k", blen, n, 2 * n)  # adjacent by chance
    assert not chunks.wants("k", blen, 2 * n, 3 * n)  # a third in a row: a stream
    assert not chunks.wants("k", blen, 3 * n, 4 * n)
    assert chunks.wants("k", blen, 10 * n, 11 * n)  # a jump: random again
    assert chunks.wants("other", blen, 11 * n, 12 * n)  # each block its own
