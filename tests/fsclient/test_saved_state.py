"""The keeper's saved state (a memfd record) and self-describing handle numbers."""

from __future__ import annotations

import os

import pytest

from blockcache_client.sources.fileinfo import FileInfo
from fsclient.handleids import HandleNumbers, file_tag, listing_tag, tag_of
from fsclient.session import Negotiated, saved

TERMS = Negotiated(major=7, minor=45, flags=0x4b011, offered=0xfff, max_readahead=131072,
                   max_write=131072, max_pages=256, max_background=64, congestion_threshold=48)


@pytest.fixture
def memfd():
    fd = saved.create()
    try:
        yield fd
    finally:
        os.close(fd)


def test_terms_and_nodes_survive_into_a_new_reader(memfd):
    first = saved.SavedState(memfd)
    assert first.terms is None and first.paths == {}
    first.save_terms(TERMS)
    first.save_node(11, "dir0")
    first.save_node(12, "dir0/odd-\udcff.bin")  # a name that is not UTF-8
    first.save_node(11, "dir0")  # once per mount
    size = first.size()
    again = saved.SavedState(memfd)
    assert again.terms == TERMS
    assert again.paths == {11: "dir0", 12: "dir0/odd-\udcff.bin"}
    assert again.size() == size and again.torn == 0


def test_a_torn_last_record_is_ignored_and_written_over(memfd):
    first = saved.SavedState(memfd)
    first.save_node(11, "dir0")
    end = first.size()
    os.pwrite(memfd, b"\x40\x00\x00\x00\x01\x02\x03\x04\x02half", end)  # a server killed mid-write
    second = saved.SavedState(memfd)
    assert second.paths == {11: "dir0"} and second.torn > 0
    second.save_node(13, "dir1")
    third = saved.SavedState(memfd)
    assert third.paths == {11: "dir0", 13: "dir1"}


def test_another_format_is_refused_with_the_fix(memfd):
    os.pwrite(memfd, b"NOT-A-SAVED-ST\x01\x00", 0)
    with pytest.raises(saved.SavedStateError, match="remount"):
        saved.SavedState(memfd)


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
