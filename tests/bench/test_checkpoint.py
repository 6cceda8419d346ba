"""bench.checkpoint at a small size: a zip written through a writable mount
equals what the CRT client and s3fs upload, and its first load through a
fresh mount fetches nothing from the remote. (Its speed targets are the
benchmark's, not this test's.)"""

import json
import os

import pytest

from bench import checkpoint

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(600)]


def test_a_small_checkpoint_is_saved_and_loaded_warm(tmp_path):
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse")
    pytest.importorskip("s3torchconnectorclient")
    checkpoint.main(["--mib", "32", "--rounds", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "checkpoint.json").read_text())
    assert result["checkpoint_bytes"] > 32 << 20 and result["entries"] == 5
    assert all(v > 0 for v in result["write_mib_s"].values())
    assert result["load_remote_bytes"] == {"first": 0, "second": 0}
    assert set(result["targets"]) == {"mount_vs_crt", "mount_vs_s3fs", "load_vs_warm"}
