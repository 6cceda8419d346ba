"""A `Volume` crosses into spawn and forkserver workers (a DataLoader's) by pickle."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import random

import pytest

from blockcache_client import Volume
from tests.support.volumes import BS, settle, volume, wait_connected


def _read_all(vol: Volume, names: list[str]) -> tuple[dict[str, str], dict]:
    """In a worker: each file's digest, and what the worker's own volume counted."""
    digests = {n: hashlib.sha256(vol.read(n, 0, 1 << 20)).hexdigest() for n in names}
    return digests, vol.stats()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_started_by_pickle_read_hits(method, source, key_file, daemon):
    rng = random.Random(18)
    files = {f"d/f{i}.bin": rng.randbytes(BS + 1000 * (i + 1)) for i in range(4)}
    for rel, data in files.items():
        source.write(rel, data)
    blocks = 2 * len(files)
    with volume(source, key_file, daemon) as vol:
        wait_connected(vol)
        for name, data in files.items():
            assert vol.read(name, 0, 1 << 20) == data
        settle(vol, daemon)
        ctx = multiprocessing.get_context(method)
        with ctx.Pool(2) as pool:
            results = pool.starmap(_read_all, [(vol, sorted(files))] * 2, chunksize=1)
    want = {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    for digests, stats in results:
        assert digests == want
        # a fresh process: nothing in memory, every block read from the cache disk
        assert (stats["hits"], stats["misses"], stats["backend_bytes"]) == (blocks, 0, 0), stats
        assert stats["integrity_failures"] == 0


def test_the_pickle_names_the_key_file_never_the_key(local_source, key_file, daemon):
    local_source.write("a.bin", b"x" * 100)
    with open(key_file, "rb") as f:
        key_text = f.read().strip()
    with volume(local_source, key_file, daemon, meta_ttl=5.0) as vol:
        blob = pickle.dumps(vol)
        assert key_file.encode() in blob
        assert vol._volume_key not in blob and key_text not in blob
        copy = pickle.loads(blob)
        try:
            assert (copy.name, copy.block_size, copy.meta_ttl) == ("vol", BS, 5.0)
            assert copy.socket_path == daemon.socket_path
            assert copy.read("a.bin", 0, 10) == b"x" * 10
        finally:
            copy.close()


def test_a_closed_volume_is_not_pickled(local_source, key_file):
    vol = volume(local_source, key_file)
    vol.close()
    with pytest.raises(ValueError, match="closed"):
        pickle.dumps(vol)


def test_a_volume_keyed_by_a_descriptor_reads_but_is_not_pickled(local_source, key_file):
    """A key given as an open descriptor (fsclient's servers, which may not
    open the key file) is read at offset 0; no other process could read it."""
    local_source.write("a.bin", b"y" * 100)
    fd = os.open(key_file, os.O_RDONLY)
    try:
        vol = volume(local_source, fd)
        try:
            assert vol.read("a.bin", 0, 10) == b"y" * 10
            assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # (pread: read again, the same)
            with pytest.raises(ValueError, match="descriptor"):
                pickle.dumps(vol)
        finally:
            vol.close()
    finally:
        os.close(fd)
