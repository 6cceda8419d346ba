"""The capacity policy on a real daemon: each scenario of `bench capacity` at a
small size (a cache of 100 blocks of ~1 KB), plus quotas, a restart, and what
stats, the CLI and the metrics show."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import capacity
from blockcache_client.contract.units import format_size
from tests.support.metrics import logged_port, scrape, value

SCALE = capacity.SCALES["tiny"]


def _check(results: list[capacity.Result]) -> None:
    missed = [r for r in results if not r.met]
    assert not missed, capacity.table(results)


@pytest.mark.parametrize("times", [1.5, 3])
def test_shuffled_epochs_reach_the_fixed_subset_optimum(times, tmp_path):
    results = capacity.shuffled_epochs(SCALE, times, epochs=4,
                                       cache=capacity.on_daemon(str(tmp_path)))
    _check(results)
    assert all(r.want >= 0.9 * r.optimum > 0 for r in results)


def test_a_dataset_that_fits_is_all_hits(tmp_path):
    _check(capacity.shuffled_epochs(SCALE, 0.9, epochs=3, cache=capacity.on_daemon(str(tmp_path))))


def test_a_new_working_set_takes_the_place_of_the_old(tmp_path):
    results = capacity.working_set_change(SCALE, cache=capacity.on_daemon(str(tmp_path)))
    _check(results)
    b3 = results[-1]
    assert b3.hit_ratio >= 0.95
    assert b3.notes["A blocks left"] <= SCALE.blocks * 0.25  # A's blocks made room
    assert b3.notes["demoted"] > 0  # by the stale rule, not by chance


def test_a_cold_sweep_leaves_the_hot_set(tmp_path):
    _check(capacity.hot_and_cold_sweep(SCALE, cache=capacity.on_daemon(str(tmp_path))))


def test_a_volume_reading_3x_its_quota_leaves_the_other_alone(tmp_path):
    results = capacity.quotas(SCALE, cache=capacity.on_daemon(str(tmp_path)))
    _check(results)
    beside = [r for r in results if "beside" in r.phase]
    assert beside and all(r.hit_ratio == r.optimum for r in beside)
    used, quota = map(int, beside[-1].notes["big used/quota"].split("/"))
    assert used <= quota


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

