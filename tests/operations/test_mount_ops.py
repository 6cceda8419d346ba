"""A real fsclient mount: its metrics endpoint, and `fsclient warmup --mount`."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from blockcache_client.common.counters import VOLUME_COUNTERS
from fsclient.metrics import COUNTERS
from tests.support.cli_runs import BLOCK, VOLUME, blocks_of, run_cli
from tests.support.fsclient_mounts import FsclientMount
from tests.support.metrics import logged_port, scrape, value

pytestmark = pytest.mark.fuse


@pytest.fixture
def mount(tmp_path, tree, key_file, daemon):
    root, _ = tree
    m = FsclientMount(root, tmp_path / "mnt", key_file, daemon.socket_path, volume=VOLUME,
                      args=["--block-size", str(BLOCK), "--metrics-addr", "127.0.0.1:0"],
                      log_path=str(tmp_path / "mnt.log"))
    try:
        daemon.wait_rebuilt()
        yield m.start()
    finally:
        m.stop()


def test_mount_metrics_parse_and_move_with_reads(mount, tree, daemon):
    root, files = tree
    port = logged_port(mount.log)
    before = scrape(port)
    assert value(before, "blockcache_client_misses_total", volume=VOLUME) == 0
    # every counter the reader keeps is exported; a first server recovered
    # nothing, and no source file changed under a read
    assert {name for name, _ in COUNTERS.values()} <= {k[0] for k in before}
    assert set(VOLUME_COUNTERS) <= set(COUNTERS)
    for name in ("blockcache_fuse_nodes_recovered_total",
                 "blockcache_fuse_handles_recovered_total",
                 "blockcache_fuse_stale_answers_total"):
        assert before[(name, (("volume", VOLUME),))] == 0
    # the server's memory against its bound, the node table's cap
    assert 0 < value(before, "blockcache_fuse_rss_bytes", volume=VOLUME) \
        < value(before, "blockcache_fuse_rss_bound_bytes", volume=VOLUME)
    assert value(before, "blockcache_fuse_max_nodes", volume=VOLUME) == 50_000
    assert value(before, "blockcache_fuse_nodes_asked_to_forget_total", volume=VOLUME) == 0

    unread = "dir2/f6.bin"  # listed with its dir, removed at the source before its read
    read = {p: s for p, s in files.items() if p != unread}
    for rel in read:
        with open(os.path.join(mount.mountpoint, rel), "rb") as f:
            assert f.read() == (root / rel).read_bytes()
    after = scrape(port)
    nblocks = sum(blocks_of(s) for s in read.values())
    misses = value(after, "blockcache_client_misses_total", volume=VOLUME)
    assert misses > 0
    # first reads: every block came from the source (some by readahead, then memory hits)
    assert value(after, "blockcache_client_backend_bytes_total", volume=VOLUME) \
        == sum(read.values())
    assert value(after, "blockcache_fuse_ops_total", volume=VOLUME, op="read") > 0
    assert value(after, "blockcache_fuse_op_seconds_count", volume=VOLUME, op="read") > 0
    # the session's workers (the mount's `threads`), none busy between requests
    assert value(after, "blockcache_fuse_workers", volume=VOLUME) == 1  # the default `threads`
    assert ("blockcache_fuse_workers_busy", (("volume", VOLUME),)) in after
    # at least one ranged read per non-empty file, at most one per block
    # (sequential reads of a multi-block file bring several blocks per request)
    reads = value(after, "blockcache_client_backend_request_seconds_count",
                  volume=VOLUME, kind="read")
    assert sum(1 for s in read.values() if s) <= reads <= nblocks
    assert value(after, "blockcache_client_daemon_connected", volume=VOLUME) == 1
    # the endpoint and the stats xattr read the same counters
    assert misses == mount.stats()["misses"]

    assert unread.split("/")[1] in os.listdir(os.path.join(mount.mountpoint, "dir2"))
    (root / unread).unlink()
    with pytest.raises(OSError):
        with open(os.path.join(mount.mountpoint, unread), "rb") as f:
            f.read()
    errors = {k: v for k, v in scrape(port).items()
              if k[0] == "blockcache_client_backend_errors_total"}
    assert any(dict(k[1])["reason"] == "not_found" and v >= 1 for k, v in errors.items()), errors


def test_warmup_through_the_mount_settings(mount, tree, daemon, key_file):
    root, files = tree
    cfg = json.loads(os.getxattr(mount.mountpoint, "user.blockcache.config"))
    assert cfg["volume"] == VOLUME and cfg["block_size"] == BLOCK
    absolute = os.path.join(mount.mountpoint, "dir1")
    r = run_cli("fsclient.cli", "warmup", "--mount", mount.mountpoint, absolute, "dir2/f0.bin")
    assert r.returncode == 0, r.stdout + r.stderr
    daemon.wait_idle()
    r = run_cli("fsclient.cli", "warmup", "--mount", mount.mountpoint, "--check", "dir1")
    assert r.returncode == 0 and "100.0%" in r.stdout, r.stdout + r.stderr

    for rel in files:  # dir1 was warmed by another process: the mount reads it as hits
        if rel.startswith("dir1/"):
            with open(os.path.join(mount.mountpoint, rel), "rb") as f:
                assert f.read() == (root / rel).read_bytes()
    s = mount.stats()
    assert s["misses"] == 0 and s["hits"] >= sum(blocks_of(files[p]) for p in files
                                                  if p.startswith("dir1/") and files[p])


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs /usr/bin/python3")
def test_config_xattr_hides_storage_options_from_other_users(tmp_path, tree, key_file, daemon,
                                                             shared_dir):
    root, _ = tree
    toml = tmp_path / "vol.toml"
    toml.write_text("[storage_options]\nauto_mkdir = false\n")
    mnt = os.path.join(shared_dir, "mnt")  # reachable by uid nobody, unlike tmp_path
    m = FsclientMount(root, mnt, key_file, daemon.socket_path, volume=VOLUME,
                      args=["--block-size", str(BLOCK), "--config", str(toml), "-o", "allow_other"],
                      log_path=str(tmp_path / "mnt.log"))
    try:
        m.start()
        mine = json.loads(os.getxattr(mnt, "user.blockcache.config"))
        assert mine["storage_options"] == {"auto_mkdir": False}
        probe = ("import json, os, sys; "
                 "print(os.getxattr(sys.argv[1], 'user.blockcache.config').decode())")
        # the system interpreter: the venv's lives under /root, which nobody cannot enter
        other = subprocess.run([SYSTEM_PYTHON, "-I", "-c", probe, mnt], capture_output=True,
                               text=True, timeout=30, user=65534, group=65534, extra_groups=[],
                               cwd="/")
        assert other.returncode == 0, other.stderr
        theirs = json.loads(other.stdout)
    finally:
        m.stop()
    assert "storage_options" not in theirs and theirs["storage_options_hidden"] is True
    assert theirs["volume"] == VOLUME and theirs["source"] == mine["source"]
