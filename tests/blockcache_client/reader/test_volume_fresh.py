"""A new reader on a warm shared cache (a DataLoader worker starting): the keys
it computes name the blocks another reader cached, and its bounded cipher
cache never serves a block under the wrong key or a changed header."""

from __future__ import annotations

import random

from blockcache_client.contract.blockfile import HEADER_SIZE
from blockcache_client.contract.blockkey import BlockKey, KeyNamer
from blockcache_client.reader.hits import ciphers as hits_mod
from blockcache_client.volumekey import load_key_file
from tests.support.volumes import BS, cached_block_path, settle, volume, wait_connected


def test_key_prefix_is_the_canonical_block_key(local_source, key_file, daemon):
    files = {"plain.bin": b"x" * 10, "dir/sub/ünï cödé.bin": b"y" * (2 * BS + 1)}
    for rel, data in files.items():
        local_source.write(rel, data)
    names = KeyNamer(load_key_file(str(key_file)))
    with volume(local_source, key_file, daemon) as vol:
        for rel in files:
            info = vol.stat(rel)
            for boff in range(0, info.size, BS):
                key = vol._key_prefix(info.path, info.version) + format(boff, "016x")
                want = BlockKey("vol", names.inode(rel), names.extent(rel, info.version, BS),
                                boff)
                assert key == str(want)
                assert BlockKey.parse(key) == want


def test_new_reader_hits_every_block_with_a_small_cipher_cache(local_source, key_file, daemon,
                                                               monkeypatch):
    rng = random.Random(7)
    files = {f"d{i % 3}/f{i}.bin": rng.randbytes(rng.randrange(1, 3 * BS)) for i in range(12)}
    for rel, data in files.items():
        local_source.write(rel, data)
    with volume(local_source, key_file, daemon) as first:
        wait_connected(first)
        for rel, data in files.items():
            assert first.read(rel, 0, len(data)) == data
        settle(first, daemon)
    # far fewer cached ciphers than blocks: entries are replaced all the time
    monkeypatch.setattr(hits_mod, "CIPHER_LIMIT", 3)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as fresh:
        wait_connected(fresh)
        for _ in range(2):
            for rel, data in files.items():
                with fresh.open(rel) as f:
                    assert f.read() == data
                assert len(fresh._hits.ciphers.by_head) <= 3
        s = fresh.stats()
        assert s["misses"] == 0 and s["backend_requests"] == 0
        assert s["hits"] == 2 * sum(-(-len(d) // BS) for d in files.values())
        # a block whose cipher is cached, rewritten with another header (a
        # refill sealed under a new salt): the cached cipher is not used for
        # it, and a tampered copy is caught, evicted and served from the source
        rel = next(iter(files))
        key, path = cached_block_path(fresh, daemon, rel)
        assert fresh.read(rel, 0, 1) == files[rel][:1]
        assert any(k == key for k, _ in fresh._hits.ciphers.by_head)
        blob = bytearray(open(path, "rb").read())
        blob[20] ^= 0x01  # the salt: a new header, so a new (and wrong) subkey
        blob[HEADER_SIZE + 5] ^= 0x01
        with open(path, "wb") as f:
            f.write(blob)
        assert fresh.read(rel, 0, len(files[rel])) == files[rel]
        assert fresh.stats()["integrity_failures"] == 1


def test_filled_blocks_read_back_with_the_cipher_their_fill_sealed(local_source, key_file,
                                                                   daemon):
    data = random.Random(3).randbytes(2 * BS + 77)
    local_source.write("f.bin", data)
    with volume(local_source, key_file, daemon, memory_cache_bytes=0) as vol:
        wait_connected(vol)
        assert vol.read("f.bin", 0, len(data)) == data
        settle(vol, daemon)
        heads = []
        for boff in range(0, len(data), BS):
            key, path = cached_block_path(vol, daemon, "f.bin", boff)
            with open(path, "rb") as f:
                heads.append((key, f.read(HEADER_SIZE)))
        # the fill thread kept each block's cipher under the header it wrote
        assert all(h in vol._hits.ciphers.by_head for h in heads)
        kept = dict(vol._hits.ciphers.by_head)
        assert vol.read("f.bin", 0, len(data)) == data
        s = vol.stats()
        assert s["hits"] == len(heads) and s["memory_hits"] == 0
        # used, not derived again
        assert all(vol._hits.ciphers.by_head[h] is kept[h] for h in heads)


def test_open_of_listed_paths(local_source, key_file, daemon):
    """A dataset opens the paths it listed: `open` takes them from the metadata
    cache without normalizing, which holds only canonical paths. Other forms
    of a path still name the same file, a name `normalize` refuses is still
    refused, and an entry older than the TTL is stat-ed again."""
    import errno
    import time

    import pytest

    data = random.Random(5).randbytes(BS + 3)
    local_source.write("d/f.bin", data)
    local_source.write("d/odd\\name.bin", b"z" * 10)  # a backslash: part of the name
    with volume(local_source, key_file, daemon, meta_ttl=0.5) as vol:
        wait_connected(vol)
        names = {e.name for e in vol.listdir("d")}
        assert names == {"f.bin", "odd\\name.bin"}
        for form in ("d/f.bin", "/d/f.bin", "d//f.bin/"):
            with vol.open(form) as f:
                assert f.name == "d/f.bin"
                assert f.read() == data
        with vol.open("d/odd\\name.bin") as f:
            assert f.read() == b"z" * 10
        with pytest.raises(OSError) as exc:
            vol.open("d/../d/f.bin")
        assert exc.value.errno == errno.EINVAL
        with pytest.raises(IsADirectoryError):
            vol.open("d")
        new = random.Random(6).randbytes(BS + 3)  # same size: only the version differs
        local_source.write("d/f.bin", new)
        time.sleep(0.6)
        with vol.open("d/f.bin") as f:
            assert f.read() == new
        vol.close()
        with pytest.raises(ValueError):
            vol.open("d/f.bin")
