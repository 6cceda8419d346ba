"""A walk over many files keeps the server bounded: the node table stays at
its cap (the kernel is asked to forget the least recently used nodes), the
saved state within its cap, the server's RSS within its bound, and files
opened during the walk still read (an open node is never forgotten).

The walk of the finding, 100,000 files, against a cap scaled down to 2,000
nodes (and small caches) so that it passes the cap 50 times over; the
INVAL_ENTRY fallback walks 30,000. (The default cap of 50,000 was measured
by hand: see fsclient/DESIGN.md.) An unbounded table grows to every file
walked, so both the peak and the RSS growth fail there.
"""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import suppress

import pytest

from fsclient import keeper as keeping
from fsclient.config import build_config
from fsclient.keeper import control
from fsclient.keeper.fdstore import hand_on
from fsclient.memory import CACHE_ENTRY_BYTES, NODE_BYTES, bound
from fsclient.pruner import FORGET_BY, saved_cap
from tests.fsclient.conftest import BLOCK
from tests.support.fsclient_mounts import FsclientMount, env, fsclient

pytestmark = pytest.mark.fuse

CAP = 2000
PER_DIR = 500
META_ENTRIES = 2000
HELD = 40  # files opened during the walk and read after it
# RSS the walk may add beyond what its nodes and caches may hold: allocator
# arenas, the saved state's mapped pages, a listing being built. Measured with
# the caps on, 2 walks at once on 2 busy cores: 7.8 MiB after 30,000 files,
# 10.7 MiB after 100,000; an unbounded node table adds ~280 bytes per file
# walked on top, several times SLACK_PER_FILE.
SLACK = 8 << 20
SLACK_PER_FILE = 50
MIB = 1 << 20


def _source(root, dirs: int) -> list[tuple[str, bytes]]:
    held = []
    for d in range(dirs):
        (root / f"class{d:03d}").mkdir(parents=True)
        for i in range(PER_DIR):
            (root / f"class{d:03d}" / f"img-{i:06d}.jpg").touch()
    for k in range(HELD):
        name = f"class{k * dirs // HELD:03d}/held-{k:03d}.bin"
        data = os.urandom(20_000 + k)
        (root / name).write_bytes(data)
        held.append((name, data))
    return held


@pytest.mark.parametrize(("forget_by", "dirs"), [("prune", 200), ("inval_entry", 60)])
def test_a_walk_over_many_files_stays_within_the_caps(tmp_path, daemon, mounts, monkeypatch,
                                                      forget_by, dirs):
    if forget_by == "inval_entry":  # (as on a kernel before 7.45; the env reaches the server)
        monkeypatch.setenv(FORGET_BY, "inval_entry")
    root = tmp_path / "remote"
    held = _source(root, dirs)
    config = tmp_path / "volume.toml"
    config.write_text(f"meta_cache_entries = {META_ENTRIES}\nmemory_cache_bytes = \"4M\"\n"
                      f"fill_queue_bytes = \"4M\"\n")
    m = mounts(root, daemon.socket_path,
               args=["--config", str(config), "--max-nodes", str(CAP), "--meta-ttl", "60"])
    mnt = m.mountpoint
    cfg = build_config({"meta_cache_entries": META_ENTRIES, "memory_cache_bytes": "4M",
                        "fill_queue_bytes": "4M"}, volume="v", source=str(root),
                       mountpoint=mnt, key_file="k", max_nodes=CAP)
    start = keeping.recovered(mnt)
    opened, peak_saved, walked = {}, 0, 0
    try:
        for dirpath, _dirs, files in os.walk(mnt):
            for name in files:
                path = os.path.join(dirpath, name)
                os.lstat(path)  # a lookup each (readdirplus entries may be bare)
                walked += 1
                if name.startswith("held-"):
                    opened[os.path.relpath(path, mnt)] = open(path, "rb")
                if walked % 2000 == 0:
                    peak_saved = max(peak_saved, keeping.recovered(mnt)["saved_bytes"])
        assert walked == dirs * PER_DIR + HELD
        time.sleep(0.5)  # (the last forgets)
        now = keeping.recovered(mnt)

        # the node table never held more than the cap; the kernel forgot the rest
        assert now["max_nodes"] == CAP
        assert now["nodes_peak"] <= CAP, now
        assert now["nodes"] <= CAP, now
        # the saved state follows, within its cap
        assert max(peak_saved, now["saved_bytes"]) <= now["saved_cap_bytes"] == saved_cap(CAP)
        assert now["saved_nodes"] <= CAP
        # RSS: within the bound, and the walk added no more than nodes and caches may hold
        assert now["server_rss_bytes"] <= now["server_rss_bound_bytes"] == bound(cfg)["total"]
        grown = now["server_rss_bytes"] - start["server_rss_bytes"]
        allowed = (CAP * NODE_BYTES + META_ENTRIES * CACHE_ENTRY_BYTES + SLACK
                   + SLACK_PER_FILE * walked)
        assert grown <= allowed, (f"RSS grew {grown / MIB:.1f} MiB, allowed {allowed / MIB:.1f}",
                                  now, start)

        # every file opened during the walk still reads, whole
        assert len(opened) == HELD
        for name, data in held:
            f = opened[name]
            f.seek(0)
            assert f.read() == data, name
    finally:
        for f in opened.values():
            f.close()

    # `fsclient status` shows the figures, in text and JSON
    text = fsclient("status", mnt)
    assert text.returncode == 0, text.stderr
    assert f"nodes of {CAP}" in text.stdout and "server RSS" in text.stdout, text.stdout
    answer = json.loads(fsclient("status", mnt, "--json").stdout)
    for key in ("server_rss_bytes", "server_rss_bound_bytes", "nodes", "max_nodes",
                "saved_bytes", "saved_cap_bytes"):
        assert isinstance(answer[key], int), (key, answer)
    assert answer["max_nodes"] == CAP
    stats = json.loads(os.getxattr(mnt, "user.blockcache.stats"))["fsclient"]
    assert stats["prune_via"] == forget_by
    assert stats["nodes_asked_to_forget"] > 0


def test_a_server_taking_over_more_nodes_than_its_cap_asks_the_kernel_to_forget(
        tmp_path, daemon, key_file):
    """A mount served with no tight cap (an older server, or a larger
    `max_nodes`) is taken over by a server with a cap of 1,000: it finds
    3,000 nodes in the saved state, never met by a lookup of its own, and
    has the kernel forget them until its table and saved state are under
    the cap; a file held open through the takeover still reads."""
    root = tmp_path / "remote"
    for d in range(3):
        (root / f"d{d}").mkdir(parents=True)
        for i in range(1000):
            (root / f"d{d}" / f"f{i:04d}").touch()
    data = os.urandom(50_000)
    (root / "held.bin").write_bytes(data)
    mp = str(tmp_path / "mnt")

    def keeper(name: str, *args: str) -> FsclientMount:
        return FsclientMount(root, mp, key_file, daemon.socket_path,
                             args=["--block-size", str(BLOCK), "--meta-ttl", "60", *args],
                             log_path=str(tmp_path / f"{name}.log"), own_session=True)

    old, new = keeper("old"), keeper("new", "--max-nodes", "1000")
    try:
        old.start()
        held = open(os.path.join(mp, "held.bin"), "rb")
        try:
            for d in range(3):
                for i in range(1000):
                    os.lstat(os.path.join(mp, f"d{d}", f"f{i:04d}"))
            assert keeping.recovered(mp)["saved_nodes"] >= 3000
            surrendered = control.surrender(mp, 60)
            passing = hand_on(surrendered.named(), env())
            try:
                new.start(passing)
            finally:
                passing.close()
            deadline = time.monotonic() + 30  # (a few rounds: under a second when idle)
            while True:
                now = keeping.recovered(mp)
                if now["max_nodes"] == 1000 and now["saved_nodes"] <= 1000 \
                        and now["nodes"] <= 1000:
                    break
                assert time.monotonic() < deadline, (now, new.log()[-3000:])
                time.sleep(0.2)
            assert now["saved_bytes"] <= now["saved_cap_bytes"]
            assert held.read() == data
        finally:
            held.close()
        assert os.stat(os.path.join(mp, "d2", "f0999")).st_size == 0  # looked up afresh
    finally:
        for m in (new, old):
            m.stop()
            if m.proc is not None:
                with suppress(ProcessLookupError):
                    os.killpg(m.proc.pid, signal.SIGKILL)


def test_more_open_files_than_the_cap_are_kept_and_lookups_go_on(tmp_path, daemon, mounts):
    """Open files are never forgotten, even past the cap: with 300 files held
    open under a cap of 100 nothing is left to ask for, and lookups go on at
    once (counted over the cap) instead of each waiting for forgets."""
    root = tmp_path / "remote"
    root.mkdir()
    for i in range(300):
        (root / f"f{i:03d}").write_bytes(b"%d" % i)
    m = mounts(root, daemon.socket_path, args=["--max-nodes", "100", "--meta-ttl", "60"])
    held = []
    start = time.monotonic()
    try:
        for i in range(300):
            held.append(open(os.path.join(m.mountpoint, f"f{i:03d}"), "rb"))
        assert time.monotonic() - start < 30  # (a 5 s wait each would take 17 minutes)
        for i, f in enumerate(held):
            assert f.read() == b"%d" % i
        stats = json.loads(os.getxattr(m.mountpoint, "user.blockcache.stats"))["fsclient"]
        assert stats["nodes"] >= 300 and stats["lookups_over_cap"] > 0, stats
    finally:
        for f in held:
            f.close()
