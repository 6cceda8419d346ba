"""The keeper's saved state (a memfd record) and self-describing handle numbers."""

from __future__ import annotations

import json
import os
import zlib

import pytest

from blockcache_client.sources.fileinfo import FileInfo
from fsclient.handleids import HandleNumbers, file_tag, listing_tag, tag_of
from fsclient.keeper import saved
from fsclient.session import Negotiated

TERMS = Negotiated(major=7, minor=45, flags=0x4b011, offered=0xfff, max_readahead=131072,
                   max_write=131072, max_pages=256, max_background=64, congestion_threshold=48)


@pytest.fixture
def memfd():
    fd = saved.create()
    try:
        yield fd
    finally:
        os.close(fd)


def blocks(fd: int) -> int:
    """Bytes of memory the memfd holds (it is sparse)."""
    return os.fstat(fd).st_blocks * 512


def test_terms_nodes_and_counts_survive_into_a_new_reader(memfd):
    first = saved.SavedState(memfd)
    assert first.terms is None and first.paths == {}
    first.save_terms(TERMS)
    assert first.looked_up(11, "dir0") == 1
    assert first.looked_up(12, "dir0/odd-\udcff.bin") == 1  # a name that is not UTF-8
    assert first.looked_up(11, "dir0") == 2  # one record, the count raised
    size = first.size()
    again = saved.SavedState(memfd)
    assert again.terms == TERMS
    assert again.paths == {11: "dir0", 12: "dir0/odd-\udcff.bin"}
    assert again.lookups(11) == 2 and again.lookups(12) == 1
    assert again.size() == size and again.torn == 0


def test_a_forgotten_node_is_gone_for_the_next_reader(memfd):
    first = saved.SavedState(memfd)
    first.looked_up(11, "a")
    first.looked_up(11, "a")
    first.looked_up(12, "b")
    assert first.forgot(11, 1) == 1 and first.forgot(12, 1) == 0
    assert first.paths == {11: "a"}
    second = saved.SavedState(memfd)
    assert second.paths == {11: "a"} and second.lookups(11) == 1 and second.lookups(12) == 0
    # looked up again: its record comes back to life, with a count of one
    assert second.looked_up(12, "b") == 1
    assert saved.SavedState(memfd).paths == {11: "a", 12: "b"}


def test_the_log_is_compacted_to_what_the_kernel_holds(memfd, monkeypatch):
    # Up to COMPACT_MIN of dead records may stay, depending on when the last
    # compaction ran beside the forgets: keep that small against the 2.4 MB log.
    monkeypatch.setattr(saved, "COMPACT_MIN", 64 << 10)
    state = saved.SavedState(memfd)
    n = 40_000
    for i in range(n):
        state.looked_up(1000 + i, f"dataset/train/class{i % 100:03d}/image{i:07d}.jpg")
    held = {1000 + i: f"dataset/train/class{i % 100:03d}/image{i:07d}.jpg"
            for i in range(0, n, 1000)}
    full, memory = state.size(), blocks(memfd)
    for i in range(n):
        if 1000 + i not in held:
            state.forgot(1000 + i, 1)
    state.join()
    assert state.compactions >= 1 and state.paths == held
    assert state.size() < full // 10
    assert blocks(memfd) < memory // 4  # the old region's pages were given back
    # the slots of dropped records are used again: the counts stay small too
    for i in range(n):
        state.looked_up(10**6 + i, f"other/{i}")
        state.forgot(10**6 + i, 1)
        state.join()
    assert state._next_slot < n + len(held) + 1000
    again = saved.SavedState(memfd)
    assert again.paths == held and all(again.lookups(i) == 1 for i in held)


def test_a_compaction_cut_before_the_header_switch_leaves_the_old_log(memfd, monkeypatch):
    state = saved.SavedState(memfd)
    for i in range(30_000):
        state.looked_up(i + 2, f"some/longer/directory/name/file{i}")
    real = os.pwrite

    def killed(fd, data, offset):  # the switch fails (or the server dies there)
        if offset == 14:
            raise OSError("killed")
        return real(fd, data, offset)

    monkeypatch.setattr(saved.os, "pwrite", killed)
    for i in range(30_000):
        if i != 7:
            state.forgot(i + 2, 1)
        if state._compactor is not None:
            break
    state.join()
    assert state.compactions == 0 and state._compactor is None
    monkeypatch.setattr(saved.os, "pwrite", real)
    after = saved.SavedState(memfd)  # the old log and its counts: the ids still held
    ids = range(2, 30_002)
    assert after.paths[9] == "some/longer/directory/name/file7" and after.lookups(9) == 1
    assert set(after.paths) == {i for i in ids if after.lookups(i)}
    assert 9 in after.paths and 0 < len(after.paths) < 30_000
    assert after.size() == state.size()
    for i in list(after.paths):  # and it compacts itself
        if i != 9:
            after.forgot(i, 1)
    after.join()
    assert after.compactions >= 1 and saved.SavedState(memfd).paths == {9: after.paths[9]}


def test_a_torn_last_record_is_ignored_and_written_over(memfd):
    first = saved.SavedState(memfd)
    first.looked_up(11, "dir0")
    end = saved.PAGE + first.size() - saved.PAGE  # (the log starts at PAGE)
    os.pwrite(memfd, b"\x40\x00\x00\x00\x01\x02\x03\x04\x02half", end)  # killed mid-write
    second = saved.SavedState(memfd)
    assert second.paths == {11: "dir0"} and second.torn > 0
    second.looked_up(13, "dir1")
    third = saved.SavedState(memfd)
    assert third.paths == {11: "dir0", 13: "dir1"} and third.torn == 0


def test_format_1_is_read_and_kept_whole(tmp_path):
    # a memfd as a keeper before counts made it: header, then every record
    fd = os.memfd_create("fsclient-saved", os.MFD_CLOEXEC)
    try:
        records = b""
        for body in (bytes([saved.TERMS]) + json.dumps(TERMS.to_dict()).encode(),
                     saved.NODE_V1.pack(saved.NODE_KIND, 11) + b"dir0",
                     saved.NODE_V1.pack(saved.NODE_KIND, 12) + b"dir0/f"):
            records += saved.RECORD.pack(len(body), zlib.crc32(body)) + body
        os.write(fd, saved.MAGIC + b"\x01\x00" + records)
        first = saved.SavedState(fd)
        assert first.terms == TERMS and first.paths == {11: "dir0", 12: "dir0/f"}
        assert first.forgot(12, 5) == saved.UNKNOWN  # counts unknown: never dropped
        again = saved.SavedState(fd)  # now format 2
        assert os.pread(fd, 16, 0)[14:] == b"\x02\x00"
        assert again.terms == TERMS and again.paths == {11: "dir0", 12: "dir0/f"}
    finally:
        os.close(fd)


def info(path: str, size: int, version: str) -> FileInfo:
    return FileInfo(path=path, name=path.rsplit("/", 1)[-1], size=size, is_dir=False,
                    is_link=False, mtime_ns=0, version=version)


def test_handle_numbers_name_the_version_they_pin():
    a, b = info("d/f", 10, "v1"), info("d/f", 10, "v2")
    numbers = HandleNumbers()
    fh = numbers.next(file_tag(a), {})
    assert tag_of(fh) == file_tag(a) != file_tag(b)
    assert file_tag(info("d/g", 10, "v1")) != file_tag(a)
    second = numbers.next(file_tag(a), {fh})
    assert second != fh and tag_of(second) == tag_of(fh)
    assert listing_tag([a, info("d/g", 1, "x")]) != listing_tag([info("d/g", 1, "x"), a])
