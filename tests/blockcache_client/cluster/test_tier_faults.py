"""Failures of the cluster tier never fail a read: dead and stalled servers,
poisoned items, a full tier, another key. Real memcached, real daemons."""

from __future__ import annotations

import os
import threading
import time

from blockcache_client.cluster.items import item_key, split
from blockcache_client.cluster.pool import REVIVALS
from blockcache_client.contract import blockfile
from blockcache_client.volumekey import generate_key_file, load_key_file
from tests.support.remote_files import random_files
from tests.support.tier import RawMemcache, all_items, block_keys

# a read's worst case with a failing server: one connect or read timeout
# (the fixture's 100 ms) per server it tries, plus the remote; generous for
# a shared 2-core machine, and far below an unbounded hang
READ_BOUND = 5.0


def _epoch(volume, files) -> float:
    """Read every file whole, checking its bytes; the slowest read's seconds."""
    worst = 0.0
    for rel, data in files.items():
        t = time.monotonic()
        assert volume.read(rel, 0, len(data)) == data
        worst = max(worst, time.monotonic() - t)
    return worst


def _filled(cluster, root, key_file, files, nservers: int = 1):
    """`nservers` memcached servers that a first host filled with `files`;
    (the servers, {block key: length})."""
    servers = cluster.memcached(nservers)
    v1 = cluster.volume(cluster.host(), str(root), key_file)
    _epoch(v1, files)
    assert v1.wait_fills(10)
    return servers, block_keys(v1, files)


def test_a_server_killed_mid_epoch(cluster, key_file, tmp_path):
    root = tmp_path / "remote"
    root.mkdir()
    files = random_files(root, 24, 300_000)
    servers, _ = _filled(cluster, root, key_file, files, 3)

    v2 = cluster.volume(cluster.host(), str(root), key_file)
    # the rest holds files whose blocks the killed server has (placement
    # follows the run's random key: any 12 files miss it 0.8% of the time)
    on_killed = {n for n in files if all_items(servers[:1], block_keys(v2, {n: files[n]}))}
    assert on_killed  # ((2/3)**24 that none is)
    picked = sorted(on_killed)[:4]
    picked += sorted(set(files) - on_killed)[:12 - len(picked)]
    rest = {n: files[n] for n in picked}
    half = {n: files[n] for n in sorted(set(files) - set(picked))}
    _epoch(v2, half)
    servers[0].kill()
    assert _epoch(v2, rest) < READ_BOUND
    s = v2.stats()
    assert s["cluster_errors"] >= 1  # noticed, then skipped
    assert s["cluster_hits"] >= 12   # the other servers' blocks still came from the tier
    # only the dead server's share of the rest went to the remote
    assert 0 < s["backend_bytes"] < sum(map(len, rest.values()))


def test_a_stalled_server_costs_a_bounded_delay_and_is_retried(cluster, key_file, tmp_path):
    root = tmp_path / "remote"
    root.mkdir()
    files = random_files(root, 16, 200_000)
    servers, _ = _filled(cluster, root, key_file, files, 2)

    servers[1].stall()  # SIGSTOP: the kernel accepts connections, nothing answers
    try:
        v2 = cluster.volume(cluster.host(), str(root), key_file)
        assert _epoch(v2, files) < READ_BOUND
        s = v2.stats()
        assert s["cluster_errors"] >= 1
        assert s["cluster_hits"] >= 1 and s["backend_bytes"] > 0
    finally:
        servers[1].resume()
    # after retry_after (1 s here) the server is used again: a new host finds
    # its blocks there (the ones the stall hid came from the remote meanwhile)
    time.sleep(1.2)
    v3 = cluster.volume(cluster.host(), str(root), key_file)
    _epoch(v3, files)
    s3 = v3.stats()
    assert s3["cluster_errors"] == 0 and s3["backend_bytes"] == 0
    assert s3["cluster_hits"] == len(files)


def test_poisoned_items_are_never_served_and_are_removed(cluster, key_file, tmp_path):
    """Items of the right size and the wrong content (one of the wrong size
    fails its server: the next test)."""
    root = tmp_path / "remote"
    root.mkdir()
    files = {"a.bin": os.urandom(300_000), "b.bin": os.urandom(300_000),
             "c.bin": os.urandom(2 << 20), "d.bin": os.urandom(300_000)}
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    (server,), keys = _filled(cluster, root, key_file, files)
    by_len = sorted(keys.items(), key=lambda kv: kv[1])
    ka, kb, kd = [k for k, blen in by_len if blen == 300_000]
    (kc, _), = [(k, b) for k, b in by_len if b == 2 << 20]
    raw = RawMemcache(server.port)
    try:
        good = all_items([server], keys)
        tampered = bytearray(good[item_key(kd, 0)])
        tampered[5000] ^= 1
        poison = {item_key(ka, 0): os.urandom(len(good[item_key(ka, 0)])),  # random bytes
                  item_key(kb, 0): good[item_key(kd, 0)],           # another block's item
                  item_key(kc, 1): good[item_key(kc, 2)],           # a slice misplaced
                  item_key(kd, 0): bytes(tampered)}                 # one bit flipped
        for name, value in poison.items():
            raw.set(name, value)

        v2 = cluster.volume(cluster.host(), str(root), key_file)
        _epoch(v2, files)  # every byte as the remote has it
        s = v2.stats()
        assert s["cluster_bad"] == 4 and s["cluster_hits"] == 0 and s["cluster_errors"] == 0
        assert s["backend_bytes"] == sum(map(len, files.values()))
        assert v2.wait_fills(10)
        # removed, and stored anew by the remote read's fill: a third host
        # reads every block from the tier, nothing bad left
        left = all_items([server], keys)
        assert all(left.get(name) != value for name, value in poison.items())
        v3 = cluster.volume(cluster.host(), str(root), key_file)
        _epoch(v3, files)
        s3 = v3.stats()
        assert s3["cluster_bad"] == 0 and s3["backend_bytes"] == 0
        assert s3["cluster_hits"] == len(keys)
    finally:
        raw.close()


def test_a_slice_of_the_wrong_size_fails_its_server_and_is_removed(cluster, key_file,
                                                                    tmp_path):
    """Its size is refused from the `VALUE` line, before a byte of it is
    read: the server's reply cannot be trusted (skipped for `retry_after`),
    and the block's items are deleted, so it does not fail the server again."""
    root = tmp_path / "remote"
    root.mkdir()
    files = {"big.bin": os.urandom(4 << 20)}
    (root / "big.bin").write_bytes(files["big.bin"])
    (server,), keys = _filled(cluster, root, key_file, files)
    (key,) = keys
    raw = RawMemcache(server.port)
    try:
        good = raw.get(item_key(key, 2))
        raw.set(item_key(key, 2), good[:len(good) // 2])  # truncated
        v2 = cluster.volume(cluster.host(), str(root), key_file)
        off = 2 * 7 * (64 << 10) + 777  # inside slice 2
        assert v2.read("big.bin", off, 4096) == files["big.bin"][off:off + 4096]
        s = v2.stats()
        assert s["cluster_bad"] == 1 and s["cluster_errors"] == 1
        assert s["backend_bytes"] == 4 << 20
        assert all(raw.get(item_key(key, i)) is None for i in range(10))  # deleted
        # after retry_after (1 s here), a read stores the block anew
        time.sleep(1.2)
        v3 = cluster.volume(cluster.host(), str(root), key_file)
        assert v3.read("big.bin", off, 4096) == files["big.bin"][off:off + 4096]
        assert v3.wait_fills(10)
        assert len(raw.get(item_key(key, 2))) == len(good)
    finally:
        raw.close()


def test_a_full_tier_only_misses(cluster, key_file, tmp_path):
    root = tmp_path / "remote"
    root.mkdir()
    files = random_files(root, 40, 1 << 20)  # 40 MiB through a tier of a few MiB
    servers = cluster.memcached(1, memory_mb=8)
    # a server busy evicting on a shared test machine may answer slowly: this
    # test is about evictions, not timeouts
    v1 = cluster.volume(cluster.host(timeout="2s"), str(root), key_file)
    _epoch(v1, files)
    assert v1.wait_fills(30)
    assert int(servers[0].stats()["evictions"]) > 0
    v2 = cluster.volume(cluster.host(timeout="2s"), str(root), key_file)
    _epoch(v2, files)
    s = v2.stats()
    assert s["cluster_bad"] == 0 and s["cluster_errors"] == 0
    assert s["cluster_misses"] > 0 and s["backend_bytes"] > 0


def test_another_key_learns_nothing_and_forged_items_are_refused(cluster, key_file,
                                                                tmp_path):
    root = tmp_path / "remote"
    root.mkdir()
    files = {"a.bin": os.urandom(300_000)}
    (root / "a.bin").write_bytes(files["a.bin"])
    (server,), keys = _filled(cluster, root, key_file, files)
    (key,) = keys

    # the same volume name under another key: other block names, so misses
    other = tmp_path / "other.key"
    generate_key_file(str(other))
    v_other = cluster.volume(cluster.host(), str(root), str(other))
    _epoch(v_other, files)
    s = v_other.stats()
    assert s["cluster_hits"] == 0 and s["cluster_bad"] == 0 and s["cluster_misses"] == 1

    # an item sealed under another key at this block's name: refused, removed
    raw = RawMemcache(server.port)
    try:
        forged = split(key, blockfile.seal(key, os.urandom(300_000), load_key_file(str(other)),
                                           64 << 10))
        raw.set(*forged[0])
        v2 = cluster.volume(cluster.host(), str(root), key_file)
        _epoch(v2, files)
        s = v2.stats()
        assert s["cluster_bad"] == 1 and s["cluster_hits"] == 0
        assert s["backend_bytes"] == 300_000
    finally:
        raw.close()


def test_a_server_that_was_only_slow_is_used_again_at_once(cluster, key_file, tmp_path):
    """A timeout alone does not say dead: a probe finds the server answering
    and reads use it again long before `retry_after`. After `REVIVALS` such
    returns within `retry_after`, a server that times out again is skipped
    for `retry_after`, probe or not."""
    root = tmp_path / "remote"
    root.mkdir()
    size = 200_000
    files = random_files(root, 12, size)
    (server,), _ = _filled(cluster, root, key_file, files)
    # a read timeout well above a loaded machine's delays, well under the stall
    v2 = cluster.volume(cluster.host(retry_after="30s", timeout="200ms"), str(root), key_file)
    pool = v2._tier.pool()
    names = iter(sorted(files))

    def read(rel):
        assert v2.read(rel, 0, size) == files[rel]

    def read_while_busy(rel):
        """Busy for longer than the read timeout, then answering again."""
        server.stall()
        # stalled 3x the read timeout: it times out even if the read starts late
        threading.Timer(0.6, server.resume).start()
        read(rel)  # timed out: from the remote

    for _ in range(REVIVALS):
        read_while_busy(next(names))
        deadline = time.monotonic() + 10
        while pool.owner("any") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        read(next(names))  # from the tier again
    s = v2.stats()
    assert s["cluster_errors"] == REVIVALS and s["cluster_hits"] == REVIVALS
    assert s["backend_bytes"] == REVIVALS * size

    read_while_busy(next(names))  # once more within retry_after: skipped
    time.sleep(0.9)  # it answers again by now
    for rel in names:
        read(rel)
    s = v2.stats()
    assert s["cluster_errors"] == REVIVALS + 1 and s["cluster_hits"] == REVIVALS
    assert s["backend_bytes"] == (len(files) - REVIVALS) * size
