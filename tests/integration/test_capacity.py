"""The capacity policy on a real daemon at a small size (a cache of 100
blocks of ~1 KB), driven as `bench capacity` drives it (look a block up; put
it on a miss): what it keeps and refuses, each hit ratio checked here against
the best a fixed subset can do, plus quotas, a restart, and what stats, the
CLI and the metrics show."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bench import capacity
from blockcache_client.contract.units import format_size
from devtools.daemon import DaemonProcess
from tests.support.metrics import logged_port, scrape, value

SCALE = capacity.SCALES["tiny"]
USABLE = capacity.usable_blocks(SCALE)   # blocks a full cache dir keeps (its high watermark)


@contextmanager
def daemon_reader(tmp_path, quotas: dict[str, int] | None = None
                  ) -> Iterator[tuple[DaemonProcess, capacity.Reader]]:
    """A daemon with one cache dir of SCALE.blocks blocks, and a reader on it."""
    config = "".join(f"[volumes.{v}]\nmax_bytes = {b}\n\n" for v, b in (quotas or {}).items())
    d = capacity.start_daemon(tmp_path, SCALE, config)
    try:
        yield d, capacity.Reader(d, SCALE.block_bytes)
    finally:
        d.stop()


def cached(d: DaemonProcess) -> set[str]:
    return set(d.client().list(None, 1000)["keys"])


def keys(vol: str, n: float) -> list[str]:
    return [capacity.key(vol, i) for i in range(int(n))]


@pytest.mark.parametrize("times", [1.5, 3])
def test_shuffled_epochs_keep_a_fixed_subset(times, tmp_path):
    """A dataset larger than the cache, read in a new order each epoch: the
    daemon keeps about one fixed subset (refusing the others) instead of
    cycling, so once it is full each epoch hits nearly the optimum usable /
    dataset (LRU gets about a third of it: tests/blockcached/test_policy.py)."""
    data = keys("data", SCALE.blocks * times)
    optimum = USABLE / len(data)
    with daemon_reader(tmp_path) as (d, r):
        # Two epochs to fill it: on a loaded machine the second fell short
        # once (0.400 against 0.653), the third was at the optimum.
        for e in (1, 2):
            r.epoch(capacity.shuffled(data, e))
        kept = []
        for e in (3, 4, 5):
            ratio = r.epoch(capacity.shuffled(data, e))
            assert ratio >= 0.9 * optimum, f"epoch {e}: {ratio:.3f}, optimum {optimum:.3f}"
            kept.append(cached(d))
        s = d.client().stats()
    assert all(k <= set(data) and len(k) <= USABLE for k in kept)
    assert len(kept[0] & kept[-1]) >= 0.9 * len(kept[-1])   # the same blocks, epoch to epoch
    assert s["put_results"]["not_admitted"] > 0 and s["policy"]["rejected"]


def test_a_dataset_that_fits_is_all_hits(tmp_path):
    data = keys("data", SCALE.blocks * 0.9)
    with daemon_reader(tmp_path) as (d, r):
        assert r.epoch(capacity.shuffled(data, 1)) == 0.0
        for e in (2, 3):
            assert r.epoch(capacity.shuffled(data, e)) == 1.0
        assert cached(d) == set(data)
        s = d.client().stats()
    assert sum(s["evictions_by_reason"].values()) == 0 and not s["put_results"].get("not_admitted")


def test_a_new_working_set_takes_the_place_of_the_old(tmp_path):
    """Job A (1.5x the cache, 3 epochs) then job B (0.8x): A's blocks stop
    hitting, the stale rule demotes them, and B's third epoch is all but all hits."""
    a, b = keys("joba", SCALE.blocks * 1.5), keys("jobb", SCALE.blocks * 0.8)
    with daemon_reader(tmp_path) as (d, r):
        for e in range(1, 4):
            r.epoch(capacity.shuffled(a, f"a{e}"))
        ratios = [r.epoch(capacity.shuffled(b, f"b{e}")) for e in range(1, 4)]
        s = d.client().stats()
        now = cached(d)
    assert ratios[-1] >= 0.95, ratios
    assert len(now & set(b)) >= 0.95 * len(b)
    assert s["volumes"].get("joba", {}).get("entries", 0) <= SCALE.blocks * 0.25
    assert s["policy"]["demoted"] > 0          # by the stale rule, not by chance


def test_a_cold_sweep_leaves_the_hot_set(tmp_path):
    """A hot set (0.5x) read throughout one pass over a cold set 3x the
    cache (a validation sweep): the sweep's blocks are refused, the hot set stays."""
    hot, cold = keys("hot", SCALE.blocks // 2), keys("cold", SCALE.blocks * 3)
    rng = random.Random(4)
    with daemon_reader(tmp_path) as (d, r):
        for e in range(1, 4):
            r.epoch(capacity.shuffled(hot, e))
        during = []
        for i, k in enumerate(cold):  # training goes on during the sweep
            r.epoch([k])
            if i % 2:
                during.append(r.epoch([rng.choice(hot)]))
        assert len(cached(d) & set(hot)) >= 0.9 * len(hot)
        after = r.epoch(capacity.shuffled(hot, "after"))
        s = d.client().stats()
    assert sum(during) / len(during) >= 0.9 and after >= 0.9
    assert s["policy"]["rejected"].get("less_frequent", 0) > 0


def test_a_volume_reading_3x_its_quota_leaves_the_other_alone(tmp_path):
    """Two volumes with quotas of half the cache each: `big` reads 3x its
    share, block by block beside `small` (0.4x of the cache), whose warm
    epochs hit as often as when it is read alone."""
    share = SCALE.blocks * capacity.file_bytes(SCALE) // 2
    quotas = {"big": share, "small": share}
    small, big = keys("small", SCALE.blocks * 0.4), keys("big", SCALE.blocks * 1.5)
    (tmp_path / "alone").mkdir()
    with daemon_reader(tmp_path / "alone", quotas) as (d, r):
        alone = [r.epoch(capacity.shuffled(small, e)) for e in range(1, 4)][1:]
    (tmp_path / "beside").mkdir()
    with daemon_reader(tmp_path / "beside", quotas) as (d, r):
        beside = []
        for e in range(1, 4):  # the two readers take turns block by block
            hits = 0
            for k_big, k_small in zip(capacity.shuffled(big, e),
                                      capacity.shuffled(small, e) + [None] * len(big)):
                r.epoch([k_big])
                if k_small is not None:
                    hits += r.epoch([k_small]) == 1.0
            beside.append(hits / len(small))
        s = d.client().stats()
    assert alone == [1.0, 1.0] and beside[1:] == alone
    assert s["volumes"]["big"]["used_bytes"] <= share
    assert s["volumes"]["small"]["entries"] == len(small)


def _config(tmp_path, text: str):
    p = tmp_path / "blockcached.toml"
    p.write_text(text)
    return ["--config", str(p)]


def test_quota_is_enforced_and_shown(tmp_path):
    fb = capacity.file_bytes(SCALE)
    args = _config(tmp_path, f'[volumes.capped]\nmax_bytes = {10 * fb}\n') + [
        "--metrics-addr", "127.0.0.1:0"]
    d = capacity.DaemonProcess(tmp_path, [(tmp_path / "cache", str(SCALE.blocks * fb))], args)
    d.start()
    try:
        r = capacity.Reader(d, SCALE.block_bytes)
        capped = [capacity.key("capped", i) for i in range(30)]
        free = [capacity.key("free", i) for i in range(30)]
        for e in range(3):
            r.epoch(capacity.shuffled(capped, e))
            r.epoch(capacity.shuffled(free, e))
        for _ in range(3):  # ten of them, now read more often, take the others' place
            r.epoch(capped[20:])
        s = d.client().stats()
        assert s["volumes"]["capped"]["used_bytes"] <= 10 * fb
        assert s["volumes"]["capped"]["quota_bytes"] == 10 * fb
        assert s["volumes"]["free"]["entries"] == 30 and s["volumes"]["free"]["quota_bytes"] == 0
        assert s["evictions_by_reason"].get("quota", 0) > 0
        assert s["policy"]["name"] == "tinylfu"
        assert s["put_results"].get("not_admitted", 0) > 0

        out = subprocess.run([sys.executable, "-m", "blockcache_client.cli", "--socket",
                              d.socket_path, "stats"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        row = next(line for line in out.stdout.splitlines() if line.startswith("capped ")).split()
        assert row[4:6] == format_size(10 * fb).split(), row  # QUOTA beside USED
        assert "admission    tinylfu: admitted" in out.stdout
        assert "refused" in out.stdout and "less_frequent" in out.stdout
        assert "quota " in next(line for line in out.stdout.splitlines()
                                if line.startswith("evictions"))

        m = scrape(logged_port(d.stderr))
        assert value(m, "blockcache_volume_quota_bytes", volume="capped") == 10 * fb
        assert value(m, "blockcache_evictions_by_reason_total", reason="quota") == \
            s["evictions_by_reason"]["quota"]
        assert value(m, "blockcache_admissions_total", result="refused",
                     reason="less_frequent") >= s["policy"]["rejected"]["less_frequent"]
    finally:
        d.stop()


def test_a_restart_keeps_the_policy_decisions(tmp_path):
    """Frequencies persist in the block files' mtimes: after a restart the
    daemon keeps the same blocks and still refuses the ones it refused."""
    fb = capacity.file_bytes(SCALE)
    d = capacity.DaemonProcess(tmp_path, [(tmp_path / "cache", str(SCALE.blocks * fb))])
    d.start()
    try:
        r = capacity.Reader(d, SCALE.block_bytes)
        data = [capacity.key("data", i) for i in range(150)]
        for e in range(3):
            r.epoch(capacity.shuffled(data, e))
        d.wait_idle()
        d.wait_stats(lambda s: all(dd["queued_jobs"] == 0 for dd in s["dirs"]))
        cached = sorted(d.client().list(None, 1000)["keys"])
        d.stop()
        d.start()
        assert sorted(d.client().list(None, 1000)["keys"]) == cached
        r = capacity.Reader(d, SCALE.block_bytes)
        ratio = r.epoch(capacity.shuffled(data, 9))
        assert ratio >= 0.9 * capacity.usable_blocks(SCALE) / len(data)
        assert sorted(d.client().list(None, 1000)["keys"]) == cached
        assert d.client().stats()["policy"]["rejected"]["less_frequent"] > 0
    finally:
        d.stop()


def test_volume_quotas_in_the_config_are_checked(tmp_path):
    bad = _config(tmp_path, '[volumes.Bad_Name]\nmax_bytes = "1G"\n')
    out = subprocess.run([sys.executable, "-m", "blockcached", "--cache-dir", str(tmp_path / "c"),
                          *bad], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "volumes.Bad_Name" in out.stderr
    bad = _config(tmp_path, '[volumes.ok]\nmax = "1G"\n')
    out = subprocess.run([sys.executable, "-m", "blockcached", "--cache-dir", str(tmp_path / "c"),
                          *bad], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "max_bytes" in out.stderr

