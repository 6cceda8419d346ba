"""Corruption on the cache disk, as a failing disk or a careless admin would
cause it: every kind at once, on blocks a reader then reads.

What must hold: 0 wrong bytes served; each bad block is counted in
`integrity_failures`, evicted through the daemon and refilled with a good
block. (tests/blockcache_client/reader/test_volume_faults.py covers flipped header,
body and tag bits, truncation and extension one at a time; here the renamed,
swapped and zero-filled cases join them, all on one cache at once.)
"""

from __future__ import annotations

import os

from blockcache_client.contract.blockfile import HEADER_SIZE, unseal
from blockcache_client.contract.errors import IntegrityError
from blockcache_client.volumekey import load_key_file
from tests.support.figures import record
from tests.support.remote_files import write_dataset
from tests.support.volumes import BS, block_key, connected_volume, fill_files
from tests.support.waiting import wait_for


def _authentic(key: str, path: str, vk: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            unseal(key, f.read(), vk)
        return True
    except (OSError, IntegrityError):
        return False


def _corrupt(paths: list[str]) -> dict[str, list[int]]:
    """Damage the block files of paths[0..7]; which file indexes each kind hit."""
    p = paths

    def rewrite(path, fn):
        with open(path, "rb") as f:
            blob = bytearray(f.read())
        with open(path, "wb") as f:
            f.write(fn(blob))

    def flip(blob):
        for pos in (HEADER_SIZE + 7, len(blob) // 2, len(blob) - 1):
            blob[pos] ^= 0x10
        return blob

    rewrite(p[0], flip)
    rewrite(p[1], lambda b: b[:len(b) - 1000])
    rewrite(p[2], lambda b: b + b"\0" * 64)
    os.rename(p[3], p[4])                       # block 3 now sits under key 4
    tmp = p[5] + ".swap"
    os.rename(p[5], tmp)
    os.rename(p[6], p[5])
    os.rename(tmp, p[6])
    rewrite(p[7], lambda b: bytes(len(b)))      # zero-filled, right length
    return {"flipped": [0], "truncated": [1], "appended": [2], "renamed": [4],
            "swapped": [5, 6], "zero_filled": [7]}


def test_every_kind_of_corruption_is_caught_evicted_and_refilled(tmp_path, key_file, daemon):
    # one block per file, all the same length, so swapped/renamed files are
    # plausible in size and only authentication can tell them apart
    files = write_dataset(str(tmp_path / "src"), [BS] * 8, seed=4)
    names = sorted(files)
    vk = load_key_file(key_file)
    with connected_volume("vol", str(tmp_path / "src"), key_file, daemon) as vol:
        layout = fill_files(vol, daemon, files)
        keys = [block_key(vol, n) for n in names]
        paths = [layout.path(k) for k in keys]
        assert all(_authentic(k, p, vk) for k, p in zip(keys, paths))
        kinds = _corrupt(paths)
        bad = sorted(i for hit in kinds.values() for i in hit)

        before = vol.stats()
        wrong = 0
        for n in names:  # 0 wrong bytes, and no read fails
            got = vol.read(n, 0, BS)
            wrong += sum(a != b for a, b in zip(got, files[n])) + abs(len(got) - BS)
        after = vol.stats()
        assert wrong == 0
        assert after["integrity_failures"] - before["integrity_failures"] == len(bad)
        assert after["hits"] == before["hits"]  # nothing bad was served as a hit
        # every bad block is evicted and refilled with a good one
        assert vol.wait_fills(10)
        daemon.wait_idle()
        wait_for(lambda: all(_authentic(keys[i], paths[i], vk) for i in bad), 10,
                 "the bad blocks to be refilled")
        # block 3 was renamed away: its key is a plain miss, but still indexed;
        # the refill's `exists` makes the daemon check the file and drop the
        # entry, so a later miss fills it again

        def refilled_3() -> bool:
            assert vol.read(names[3], 0, BS) == files[names[3]]
            vol.wait_fills(10)
            daemon.wait_idle()
            return _authentic(keys[3], paths[3], vk)
        wait_for(refilled_3, 10, "the renamed-away block to be filled again")
        before_last = vol.stats()
        for n in names:  # now all hits again
            assert vol.read(n, 0, BS) == files[n]
        final = vol.stats()
        assert final["hits"] - before_last["hits"] == len(names)
        assert final["integrity_failures"] == after["integrity_failures"]
        s = daemon.client().stats()
        assert s["requests"]["evict"] >= len(bad)  # each bad block was evicted by its reader
        record("corruption", kinds=sorted(kinds), bad_blocks=len(bad), wrong_bytes=wrong,
               integrity_failures=after["integrity_failures"] - before["integrity_failures"],
               refilled=len(bad) + 1, evict_requests=s["requests"]["evict"])
