"""The read order with a cluster tier: memory -> local cache disk -> tier ->
remote, with real memcached servers and one real daemon per host."""

from __future__ import annotations

import os
import random
import signal

from blockcache_client.cluster.items import SLICE_LIMIT, split
from blockcache_client.contract import blockfile
from blockcache_client.volumekey import load_key_file
from tests.support.tier import RawMemcache, all_items, block_keys

BS = 4 << 20


def _remote_files(tmp_path, n: int, size: int):
    """A local "remote" dir of `n` random files of `size` bytes: (dir, {name: bytes})."""
    root = tmp_path / "remote"
    root.mkdir()
    files = {f"f{i:02d}.bin": os.urandom(size) for i in range(n)}
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    return root, files


def _fill_tier(cluster, key_file, root, files) -> None:
    """A first host reads every file from the remote: that fills the tier."""
    v1 = cluster.volume(cluster.host(), str(root), key_file)
    for rel, data in files.items():
        assert v1.read(rel, 0, len(data)) == data
    assert v1.wait_fills(10)


def _read_all(cluster, host, root, key_file, files) -> dict:
    """A new reader on `host` reads every file, bytes-exact: its stats."""
    v = cluster.volume(host, str(root), key_file)
    for rel, data in files.items():
        assert v.read(rel, 0, len(data)) == data
    return v.stats()


def test_second_host_reads_the_tier_then_its_own_disk(cluster, key_file, dataset):
    root, files = dataset
    cluster.memcached(2)
    h1, h2 = cluster.host(), cluster.host()
    v1 = cluster.volume(h1, root, key_file)
    for rel, data in files.items():
        assert v1.read(rel, 0, len(data)) == data
    assert v1.wait_fills(10)
    s1 = v1.stats()
    assert s1["cluster_hits"] == 0 and s1["cluster_fills_sent"] == 5  # 1 + 1 + 3 blocks
    remote_once = s1["backend_bytes"]

    v2 = cluster.volume(h2, root, key_file)
    for rel, data in files.items():
        assert v2.read(rel, 0, len(data)) == data
    s2 = v2.stats()
    assert s2["backend_bytes"] == 0 and s2["backend_requests"] == 0
    assert s2["cluster_hits"] == 5 and s2["cluster_misses"] == 0
    assert s2["cluster_bytes"] >= remote_once
    # handed to this host's daemon as they came: the next process reads them locally
    assert v2.wait_fills(10)
    h2.wait_idle()
    assert h2.client().stats()["volumes"]["ds"]["entries"] == 5
    v2b = cluster.volume(h2, root, key_file)
    buf = bytearray(len(files["big.bin"]))
    assert v2b.readinto("big.bin", 0, buf) == len(buf) and bytes(buf) == files["big.bin"]
    s2b = v2b.stats()
    assert s2b["hits"] == 3 and s2b["cluster_hits"] == 0 and s2b["cluster_misses"] == 0


def test_blocks_read_in_a_row_reach_the_daemon_whole(cluster, key_file, tmp_path):
    """A tier hit's items land in a buffer that is reused once the daemon
    has the block file: many hits in a row, faster than the hand-off, must
    still each give the daemon their own block, bytes-exact."""
    root, files = _remote_files(tmp_path, 16, 1 << 20)
    cluster.memcached(2)
    _fill_tier(cluster, key_file, root, files)

    h2 = cluster.host()
    v2 = cluster.volume(h2, str(root), key_file)
    h2.proc.send_signal(signal.SIGSTOP)  # hand-offs wait: every buffer is still in use
    try:
        for rel, data in files.items():
            assert v2.read(rel, 0, len(data)) == data
    finally:
        h2.proc.send_signal(signal.SIGCONT)
    s2 = v2.stats()
    assert s2["cluster_hits"] == len(files) and s2["backend_bytes"] == 0
    assert v2.wait_fills(10)
    h2.wait_idle()
    # another process on that host: every block from the cache disk, authentic
    s3 = _read_all(cluster, h2, root, key_file, files)
    assert s3["hits"] == len(files) and s3["integrity_failures"] == 0
    assert s3["cluster_hits"] == 0 and s3["backend_bytes"] == 0


def test_a_random_read_inside_a_block_moves_one_slice(cluster, key_file, dataset):
    root, files = dataset
    cluster.memcached(3)
    h1, h2 = cluster.host(), cluster.host()
    v1 = cluster.volume(h1, root, key_file)
    big = files["big.bin"]
    v1.read("big.bin", 0, len(big))
    assert v1.wait_fills(10)

    v2 = cluster.volume(h2, root, key_file)
    rng = random.Random(7)
    offsets = [rng.randrange(1, len(big) - 4096) for _ in range(40)]
    # far from the last read's end: nearby reads in a row are taken for a stream
    offsets = [o for p, o in zip([-(1 << 30)] + offsets, offsets)
               if abs(o - p) > (1 << 20) and o % BS]
    for off in offsets[:12]:
        before = v2.stats()["cluster_bytes"]
        assert v2.read("big.bin", off, 4096) == big[off:off + 4096]
        moved = v2.stats()["cluster_bytes"] - before
        assert 0 < moved <= 1 << 20, (off, moved)
    s = v2.stats()
    assert s["backend_bytes"] == 0 and s["cluster_bad"] == 0
    # a range across a slice boundary takes both slices, still bytes-exact
    edge = (SLICE_LIMIT // (64 << 10 | 16)) * (64 << 10)  # where slice 1 starts
    assert v2.read("big.bin", edge - 100, 300) == big[edge - 100:edge + 200]


def test_items_hold_only_ciphertext_and_fills_never_overwrite(cluster, key_file, dataset):
    root, files = dataset
    servers = cluster.memcached(2)
    v1 = cluster.volume(cluster.host(), root, key_file)
    for rel, data in files.items():
        v1.read(rel, 0, len(data))
    assert v1.wait_fills(10)
    keys = block_keys(v1, files)
    items = all_items(servers, keys)
    assert len(items) == 1 + 3 + 10 + 10 + 1  # 100 kB; 1 MiB; 4 MiB, 4 MiB, 12345 B
    assert max(map(len, items.values())) <= SLICE_LIMIT
    for data in files.values():
        probe = data[1000:1064]
        assert not any(probe in v for v in items.values())

    # another host's fill of a block the tier holds (`add`) changes nothing
    (small_key,) = [k for k, blen in keys.items() if blen == len(files["small.bin"])]
    v2 = cluster.volume(cluster.host(), root, key_file)
    other_copy = blockfile.seal(small_key, files["small.bin"], load_key_file(key_file))
    v2._tier.offer(small_key, other_copy)
    assert v2.wait_fills(10)
    assert all_items(servers, keys) == items
    assert v2.stats()["cluster_fills_sent"] == 0


def test_two_hosts_copies_of_a_block_never_mix(cluster, key_file, tmp_path):
    (m,) = cluster.memcached(1)
    root = tmp_path / "remote"
    root.mkdir()
    v = cluster.volume(cluster.host(), str(root), key_file)
    key = "ds_1_" + "0" * 32 + "_" + "0" * 16
    plain = os.urandom(1 << 20)
    copy_a = split(key, blockfile.seal(key, plain, load_key_file(key_file), 64 << 10))
    copy_b = split(key, blockfile.seal(key, plain, load_key_file(key_file), 64 << 10))
    raw = RawMemcache(m.port)
    try:
        # host A's fill is under way: its first item is in, the rest not yet
        assert raw.add(*copy_a[0])
        v._tier.pool().offer_fill(key, copy_b, v.counters)
        assert v._tier.wait(10)
        held = raw.get_many([name for name, _ in copy_a])
        assert held == {copy_a[0][0]: copy_a[0][1]}  # B added nothing of its own
        # A's first item was evicted, its others stayed: B's copy replaces it whole
        raw.delete_many([copy_a[0][0]])
        for name, value in copy_a[1:]:
            raw.add(name, value)
        v._tier.pool().offer_fill(key, copy_b, v.counters)
        assert v._tier.wait(10)
        assert raw.get_many([name for name, _ in copy_b]) == dict(copy_b)
    finally:
        raw.close()


def _tier_blocks_reach_the_daemon(cluster, key_file, tmp_path, prepare=lambda v: None):
    """Host 1 fills the tier; host 2 reads 12 blocks from it, one at a time;
    a third reader on host 2 then hits them all on its disk, authentic.
    Returns host 2's daemon stats."""
    root, files = _remote_files(tmp_path, 12, 512 << 10)
    cluster.memcached(1)
    _fill_tier(cluster, key_file, root, files)
    h2 = cluster.host()
    v2 = cluster.volume(h2, str(root), key_file)
    prepare(v2)
    for rel, data in files.items():
        assert v2.read(rel, 0, len(data)) == data
        assert v2.wait_fills(10)  # the first hand-off has the fill area opened
    assert v2.stats()["cluster_hits"] == len(files)
    h2.wait_idle()
    s3 = _read_all(cluster, h2, root, key_file, files)
    assert s3["hits"] == len(files) and s3["integrity_failures"] == 0
    assert s3["backend_bytes"] == 0 and s3["cluster_hits"] == 0
    return h2.client().stats()


def test_tier_blocks_go_to_the_daemon_through_the_fill_area(cluster, key_file, tmp_path):
    areas = _tier_blocks_reach_the_daemon(cluster, key_file, tmp_path)["fill_areas"]
    # the first block goes by value (the area is opened after it), the rest
    # by reference whenever a slot was free
    assert areas["opened"] == 1 and areas["puts"] >= 1, areas


def test_without_a_fill_area_tier_blocks_go_by_value(cluster, key_file, tmp_path):
    def take_the_area(v):
        # the fill connection's one area, taken before the link asks: the
        # daemon refuses the link's request, as one without areas would
        os.close(v._link._filler_client.open_area(1, 4096)[0])

    areas = _tier_blocks_reach_the_daemon(cluster, key_file, tmp_path,
                                          take_the_area)["fill_areas"]
    assert areas == {"opened": 1, "puts": 0}


def test_a_restarted_daemon_gives_the_reader_a_new_fill_area(cluster, key_file, tmp_path):
    """The area belongs to the connection it was opened on: after the daemon
    restarts, no put names a slot of the old one, and the reader opens a
    new area on its new connection."""
    root, files = _remote_files(tmp_path, 12, 256 << 10)
    cluster.memcached(1)
    _fill_tier(cluster, key_file, root, files)
    h2 = cluster.host()
    v2 = cluster.volume(h2, str(root), key_file)
    names = sorted(files)
    for rel in names[:4]:
        assert v2.read(rel, 0, len(files[rel])) == files[rel]
        assert v2.wait_fills(10)
    assert h2.client().stats()["fill_areas"]["opened"] == 1
    h2.restart()
    # the link's control thread notices and says hello again: from then on
    # only the fill connection still holds the old area
    h2.wait_stats(lambda st: st["requests"].get("hello", 0) >= 1, timeout=30)
    for rel in names[4:]:
        assert v2.read(rel, 0, len(files[rel])) == files[rel]
        v2.wait_fills(10)
    h2.wait_idle()
    areas = h2.client().stats()["fill_areas"]  # the new daemon's
    assert areas["opened"] == 1 and areas["puts"] >= 1, areas
    # what reached the new daemon is authentic: a new reader hits it
    s3 = _read_all(cluster, h2, root, key_file, files)
    assert s3["integrity_failures"] == 0 and s3["backend_bytes"] == 0
    assert s3["hits"] >= 4 + len(names[4:]) - 2  # at most the first two after the restart missed
