"""bench.fuse_requests counts what the kernel sends one fsclient mount, by opcode."""

import os

import pytest

from bench import fuse_requests
from tests.support.hostcaches import host_caches

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tracefs and mounting need root"),
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse"),
]


def test_warm_small_files_cost_an_open_and_a_release_each(bench_ctx, tmp_path_factory):
    try:
        # no host-wide drop here (a test beside this one would see its mount's
        # nodes forgotten), nor one by another test meanwhile (a warm epoch
        # would look its files up again)
        with host_caches(tmp_path_factory):
            rows = fuse_requests.measure(bench_ctx, readers=2, rounds=1, repeat=2,
                                         timeout=120, report=lambda line: None,
                                         drop_caches=False)
    except RuntimeError as exc:
        if "tracepoint" in str(exc) or "tracefs" in str(exc):
            pytest.skip(str(exc))
        raise
    cold, warm = rows
    files = bench_ctx.size.files
    assert (cold["phase"], cold["files"], warm["phase"], warm["files"]) == (
        "cold", files, "warm", 2 * files)
    # cold: each file opened once and read by requests (the server's CPU counted)
    assert cold["requests_per_file"]["OPEN"] == 1.0
    assert cold["requests_per_file"]["READ"] >= 1.0
    assert cold["server_us_per_file"] > 0
    # warm: the kernel kept the entries and the pages; an open and its release
    # each, nothing read (a kernel that dropped a page meanwhile may read one)
    assert warm["requests_per_file"]["OPEN"] == 1.0
    assert 0.9 <= warm["requests_per_file"].get("RELEASE", 0) <= 1.0
    assert warm["requests_per_file"].get("READ", 0) <= 0.1
    assert "LOOKUP" not in warm["requests_per_file"]
    assert warm["files_per_s"] > 0 and warm["server_switches_per_file"] >= 0
