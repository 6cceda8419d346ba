"""Block keys: canonical round trip and strict rejection (DESIGN.md "Block key")."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockcache_client.contract.blockkey import (
    MAX_INODE,
    ROOT_INODE,
    BlockKey,
    KeyNamer,
    is_block_name,
    key_prefix,
)
from blockcache_client.contract.errors import InvalidKey

vol_names = st.from_regex(r"\A[a-z0-9][a-z0-9.-]{0,62}\Z")
keys = st.builds(BlockKey, vol_names, st.integers(1, MAX_INODE),
                 st.integers(0, 2**128 - 1), st.integers(0, 2**64 - 1))


@given(keys)
def test_round_trip(key):
    text = str(key)
    assert BlockKey.parse(text) == key
    assert str(BlockKey.parse(text)) == text


@given(keys)
def test_key_is_a_single_safe_path_component(key):
    text = str(key)
    assert "/" not in text and "\0" not in text
    assert text not in (".", "..")


GOOD = "imagenet_42_000000000000000000000000deadbeef_0000000000400000"


@pytest.mark.parametrize("bad", [
    "", "_", GOOD + "\0", "\0" + GOOD, GOOD + "/", "../" + GOOD,
    "a/b_42_000000000000000000000000deadbeef_0000000000400000",
    "..", "._1_00000000000000000000000000000000_0000000000000000",
    "imagenet_042_000000000000000000000000deadbeef_0000000000400000",     # leading zero
    "imagenet_0_000000000000000000000000deadbeef_0000000000400000",       # inode 0
    "imagenet_9223372036854775808_000000000000000000000000deadbeef_0000000000400000",  # 2**63
    "imagenet_42_00000000DEADBEEF_0000000000400000",      # uppercase hex
    "imagenet_42_0000000deadbeef_0000000000400000",       # 15 digits
    "imagenet_42_0000000000000000000000000deadbeef_0000000000400000",     # 17 digits
    "imagenet_42_000000000000000000000000deadbeef_00000000004000000",
    "ImageNet_42_000000000000000000000000deadbeef_0000000000400000",      # uppercase volume
    "-vol_42_000000000000000000000000deadbeef_0000000000400000",
    "a" * 64 + "_42_000000000000000000000000deadbeef_0000000000400000",   # volume over 63
    "imagenet_+42_000000000000000000000000deadbeef_0000000000400000",
    "imagenet_42_000000000000000000000000deadbeef_0000000000400000 ",
    " imagenet_42_000000000000000000000000deadbeef_0000000000400000",
    "imagenet_42_000000000000000000000000deadbeef_0000000000400000\n",
    "imagenet_42_0x000000deadbeef_0000000000400000",
    "imagenet_٤٢_000000000000000000000000deadbeef_0000000000400000",       # non-ASCII digits
    "imagenet_42_00000000deadbeef",
    "imagenet_42_000000000000000000000000deadbeef_0000000000400000_1",
    GOOD * 3,
])
def test_rejects_non_canonical(bad):
    with pytest.raises(InvalidKey):
        BlockKey.parse(bad)


@pytest.mark.parametrize("bad", [None, 42, ["x"],
                                 b"imagenet_42_000000000000000000000000deadbeef_0000000000400000"])
def test_rejects_non_str(bad):
    with pytest.raises(InvalidKey):
        BlockKey.parse(bad)


@given(st.text(max_size=80))
def test_parse_accepts_only_what_it_prints(text):
    try:
        key = BlockKey.parse(text)
    except InvalidKey:
        return
    assert str(key) == text


@pytest.mark.parametrize("args", [
    ("", 1, 0, 0), ("Vol", 1, 0, 0), ("v/x", 1, 0, 0), ("v", 0, 0, 0), ("v", 2**63, 0, 0),
    ("v", True, 0, 0), ("v", 1, -1, 0), ("v", 1, 2**128, 0), ("v", 1, 0, 2**64), ("v", 1, 0, 1.5),
    ("v", 1, "0", 0),
])
def test_constructor_validates(args):
    with pytest.raises(InvalidKey):
        BlockKey(*args)


def test_prefix_separates_volumes():
    assert key_prefix("a") == "a_"
    assert not str(BlockKey("ab", 5, 0, 0)).startswith(key_prefix("a"))
    assert str(BlockKey("a", 5, 0, 0)).startswith(key_prefix("a", 5))
    assert not str(BlockKey("a", 55, 0, 0)).startswith(key_prefix("a", 5))


KEY = bytes(range(32))
NAMES = KeyNamer(KEY)
inode_for_path, extent_for = NAMES.inode, NAMES.extent


@given(st.text(min_size=1, max_size=60).filter(lambda p: p.strip("/")))
def test_inode_stable_and_in_range(path):
    ino = inode_for_path(path)
    assert ROOT_INODE < ino <= MAX_INODE
    assert ino == inode_for_path(path)
    assert ino == inode_for_path("/" + path.strip("/") + "/")


def test_root_inode():
    assert inode_for_path("") == inode_for_path("/") == ROOT_INODE


def test_extent_changes_with_version_block_size_and_path():
    e = extent_for("a/b.jpg", "etag1", 4 << 20)
    assert e == extent_for("a/b.jpg", "etag1", 4 << 20)
    assert len({e, extent_for("a/b.jpg", "etag2", 4 << 20), extent_for("a/b.jpg", "etag1", 1 << 20),
                extent_for("a/c.jpg", "etag1", 4 << 20)}) == 4
    assert 0 <= e < 2**128


@given(st.text(max_size=40), st.text(max_size=30))
def test_names_depend_on_the_volume_key(path, version):
    """Another key is another namespace: one volume name under two keys never
    shares a block name, and nobody without the key can recompute one."""
    other = KeyNamer(bytes(31) + b"\1")
    assert NAMES.extent(path, version, 4096) != other.extent(path, version, 4096)
    if path.strip("/"):
        assert NAMES.inode(path) != other.inode(path)


@pytest.mark.parametrize("bad", ["vol\n", "vol\n\n", "", "a" * 64, "_a", ".a", "a_b", "a/b"])
def test_volume_name_rejected(bad):
    from blockcache_client.contract.blockkey import check_volume_name
    with pytest.raises(InvalidKey):
        check_volume_name(bad)


def _spec_digest(size: int, *parts: bytes) -> int:
    """The ids' definition, written out (blockkey.py computes it from seeded states)."""
    import hashlib

    from blockcache_client.contract.blockfile import hkdf_sha256
    key = hkdf_sha256(KEY, b"", b"blockcache key names v2")
    h = hashlib.blake2b(digest_size=size, key=key, person=b"blockcache-id")
    for p in parts:
        h.update(len(p).to_bytes(4, "big") + p)
    return int.from_bytes(h.digest(), "big")


# Every host and every release must name the same bytes with the same keys:
# these values (key format 2, volume key bytes(range(32))) were computed when
# the ids were defined and must never change.
KNOWN_IDS = [
    ("a/b.jpg", "etag1", 4 << 20, 8833286027227912037, 0x79aa0ec2fce3db7544b53884006920fd),
    ("class001/img000123.jpg", "1700000000000000000-112640", 128 << 10,
     1402602618126180441, 0xccc0706f2b5108e8a221c8da2c132e30),
    ("d\udcff/x", "etag1", 4 << 20, 654836444594916134, 0xfe686d353628733ca2535d6a8fb8c1bc),
    ("é/ü.bin", "1700000000000000000-112640", 128 << 10, 5418936514568510564,
     0x2a3bcb29ffabf3e0189d2dccef06c6ba),
]


@pytest.mark.parametrize("path, version, block_size, inode, extent", KNOWN_IDS)
def test_ids_keep_their_known_values(path, version, block_size, inode, extent):
    assert inode_for_path(path) == inode == inode_for_path(f"/{path}/")
    assert extent_for(path, version, block_size) == extent
    assert NAMES.file_ids(path, version, block_size) == (inode, extent)
    assert NAMES.file_prefix("vol", path, version, block_size) == f"vol_{inode}_{extent:032x}_"


@given(st.text(max_size=40), st.text(max_size=30), st.integers(1, 2**40))
def test_ids_follow_their_definition(path, version, block_size):
    p = path.strip("/").encode("utf-8", "surrogateescape")
    ino = _spec_digest(8, b"inode", p) & MAX_INODE
    want_ino = ROOT_INODE if not p else (ino if ino > ROOT_INODE else ino + 2)
    want_ext = _spec_digest(16, b"extent", p, version.encode("utf-8", "surrogateescape"),
                            str(block_size).encode())
    assert NAMES.file_ids(path, version, block_size) == (want_ino, want_ext)
    assert (inode_for_path(path), extent_for(path, version, block_size)) == (want_ino, want_ext)
    assert NAMES.file_prefix("v", path, version, block_size) == str(
        BlockKey("v", want_ino, want_ext, 0))[:-16]


_NAME_CHARS = "abz09._-_/x\n"


@settings(max_examples=500, deadline=None)
@given(st.one_of(
    st.text(alphabet=_NAME_CHARS, max_size=60),
    st.builds(lambda v, i, e, o: f"{v}_{i}_{e:032x}_{o:016x}",
              st.from_regex(r"[a-z0-9][a-z0-9.-]{0,62}", fullmatch=True),
              st.integers(0, 10**19 - 1), st.integers(0, 2**128 - 1), st.integers(0, 2**64 - 1)),
    st.sampled_from([f"v_{2**63 - 1}_{0:032x}_{0:016x}", f"v_{2**63}_{0:032x}_{0:016x}",
                     f"v_{10**18}_{0:032x}_{0:016x}", f"v_01_{0:032x}_{0:016x}",
                     f"v_1_{0:032x}_{0:016x}\n"]),
))
def test_scan_name_check_agrees_with_parse(name):
    """The daemon scan's cheap name check keeps exactly the names BlockKey.parse accepts."""
    try:
        BlockKey.parse(name)
        parsed = True
    except InvalidKey:
        parsed = False
    assert is_block_name(name) == parsed
