"""fsclient.session.structs and negotiate: the layouts match the kernel's
include/uapi/linux/fuse.h byte for byte, and INIT is negotiated as it says."""

from __future__ import annotations

import stat

import pytest

from fsclient.session import structs as s
from fsclient.session.negotiate import WANTED, Negotiated, ProtocolError, negotiate


@pytest.mark.parametrize("layout, size", [
    (s.IN_HEADER, 40), (s.OUT_HEADER, 16), (s.ATTR, 88), (s.ENTRY_HEAD, 40),
    (s.ATTR_OUT_HEAD, 16), (s.DIRENT, 24), (s.INIT_IN, 64), (s.INIT_IN_OLD, 16),
    (s.INIT_OUT, 64), (s.FORGET_IN, 8), (s.BATCH_FORGET_IN, 8), (s.FORGET_ONE, 16),
    (s.GETATTR_IN, 16), (s.OPEN_IN, 8), (s.OPEN_OUT, 16), (s.OPEN_REPLY, 32), (s.READ_IN, 40),
    (s.RELEASE_IN, 24), (s.FLUSH_IN, 24), (s.GETXATTR_IN, 8), (s.GETXATTR_OUT, 8),
    (s.ACCESS_IN, 8), (s.INTERRUPT_IN, 8), (s.STATFS_OUT, 80), (s.NOTIFY_STORE_OUT, 24),
])
def test_struct_sizes_are_the_kernels(layout, size):
    assert layout.size == size


def test_an_open_reply_packed_whole_is_its_header_and_open_out():
    whole = s.OPEN_REPLY.pack(s.OPEN_REPLY.size, 0, 99, 1 << 40, s.FOPEN_KEEP_CACHE, 0)
    assert whole == s.OUT_HEADER.pack(32, 0, 99) + s.OPEN_OUT.pack(1 << 40, s.FOPEN_KEEP_CACHE, 0)


def _attrs() -> s.Attributes:
    a = s.Attributes()
    a.st_ino, a.st_size, a.st_mode = 77, 5000, stat.S_IFREG | 0o644
    a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = 1_700_000_000_123_456_789
    a.st_uid, a.st_gid, a.st_blocks, a.st_blksize = 10, 20, 10, 131072
    a.entry_timeout, a.attr_timeout = 2.5, 60.0
    return a


def test_entry_and_attr_replies_decode_to_what_was_encoded():
    a = _attrs()
    entry = s.pack_entry(a)
    assert len(entry) == s.ENTRY_SIZE == 128
    nodeid, gen, ev, av, ens, ans = s.ENTRY_HEAD.unpack_from(entry)
    assert (nodeid, gen, ev, ens, av, ans) == (77, 0, 2, 500_000_000, 60, 0)
    fields = s.ATTR.unpack_from(entry, s.ENTRY_HEAD.size)
    assert fields[:5] == (77, 5000, 10, 1_700_000_000, 1_700_000_000)
    assert fields[6:13] == (123_456_789, 123_456_789, 123_456_789, stat.S_IFREG | 0o644, 1,
                            10, 20)
    out = s.pack_attr_out(a)
    assert len(out) == s.ATTR_OUT_SIZE == 104 and out[s.ATTR_OUT_HEAD.size:] == entry[40:]
    negative = s.Attributes()
    negative.entry_timeout = 3.0
    assert s.ENTRY_HEAD.unpack_from(s.pack_entry(negative))[:3] == (0, 0, 3)


@pytest.mark.parametrize("name", [b"a", b"1234567", b"12345678", b"x" * 255])
def test_dirents_are_padded_to_8_bytes(name):
    d = s.pack_dirent(name, 9, 4, stat.S_IFDIR | 0o755)
    assert len(d) % 8 == 0 and len(d) == s.dirent_size(name, False)
    assert s.dirent_size(name, True) == len(d) + s.ENTRY_SIZE
    ino, off, namelen, dtype = s.DIRENT.unpack_from(d)
    assert (ino, off, namelen, dtype) == (9, 4, len(name), 4)  # DT_DIR
    assert d[24:24 + namelen] == name and not any(d[24 + namelen:])


def _init_body(major=7, minor=45, flags=0xFFFFFFFF, flags2=0) -> bytes:
    return s.INIT_IN.pack(major, minor, 131072, flags | s.INIT_EXT, flags2)


def test_init_grants_only_what_the_kernel_offers_and_we_want():
    terms, reply = negotiate(_init_body())
    assert len(reply) == s.INIT_OUT.size
    major, minor, readahead, flags, bg, congestion, max_write, gran, pages, *_ = \
        s.INIT_OUT.unpack(reply)
    assert (major, minor, readahead, flags) == (7, 45, 131072, WANTED)
    assert pages == 256 and max_write == terms.max_write and gran == 1
    assert terms.has(s.ASYNC_READ) and terms.has(s.DO_READDIRPLUS)
    assert terms.has(s.PARALLEL_DIROPS) and terms.has(s.CACHE_SYMLINKS)
    # a kernel newer than us speaks our minor; one that lacks a flag is not given it
    terms, _ = negotiate(_init_body(minor=50, flags=s.ASYNC_READ))
    assert terms.minor == s.KERNEL_MINOR and terms.flags == s.ASYNC_READ
    assert terms.max_pages == 0  # MAX_PAGES not offered: the kernel's default
    # the pre-7.36 16-byte request is read too
    terms, _ = negotiate(s.INIT_IN_OLD.pack(7, 34, 65536, s.ASYNC_READ))
    assert (terms.minor, terms.max_readahead) == (34, 65536)


@pytest.mark.parametrize("body, why", [
    (_init_body(major=8), "speaks FUSE 8"),
    (_init_body(minor=30), "needs 7.31"),
    (b"\x07\x00", "too short"),
])
def test_init_refuses_what_it_cannot_speak(body, why):
    with pytest.raises(ProtocolError, match=why):
        negotiate(body)


def test_terms_round_trip_for_the_next_process():
    terms, _ = negotiate(_init_body())
    again = Negotiated.from_dict(dict(terms.to_dict()))
    assert again == terms
    with pytest.raises(ValueError, match="unknown keys"):
        Negotiated.from_dict({**terms.to_dict(), "surprise": 1})


def test_fsclient_fuse_minor_speaks_as_an_older_kernel(monkeypatch):
    # FSCLIENT_FUSE_MINOR=39 on a 7.45 kernel: 7.39 answered, no resend, and
    # none of the INIT flags 7.40 brought (passthrough, has_resend: bits 37 on)
    monkeypatch.setenv("FSCLIENT_FUSE_MINOR", "39")
    terms, reply = negotiate(_init_body(flags2=0xFFFFFFFF))
    assert terms.minor == 39 and s.INIT_OUT.unpack(reply)[1] == 39
    assert not terms.resends and terms.flags == WANTED
    assert terms.offered >> 37 == 0 and terms.offered >> 32 & 0x1F == 0x1F
    # never above what the kernel speaks
    terms, _ = negotiate(_init_body(minor=36))
    assert terms.minor == 36
    monkeypatch.delenv("FSCLIENT_FUSE_MINOR")
    terms, _ = negotiate(_init_body(flags2=0xFFFFFFFF))
    assert terms.minor == 45 and terms.resends and terms.offered >> 37


@pytest.mark.parametrize("value", ["abc", "30", "46", "-1"])
def test_a_bad_fsclient_fuse_minor_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("FSCLIENT_FUSE_MINOR", value)
    with pytest.raises(ProtocolError, match="FSCLIENT_FUSE_MINOR=.* unset it"):
        negotiate(_init_body())
