"""`blockcache-cli stats`: per-volume hit ratio, dirs against watermarks, --json, --watch."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

from blockcache_client import Volume
from tests.support.cli_runs import BLOCK, VOLUME, blocks_of, run_cli, warmup_args
from tests.support.fsclient_mounts import REPO, env


def cli(daemon, *args: str) -> subprocess.CompletedProcess:
    return run_cli("blockcache_client.cli", "--socket", daemon.socket_path, "stats", *args)


def test_stats_show_per_volume_hit_ratio_and_dirs(daemon, tree, key_file):
    root, files = tree
    nblocks = sum(blocks_of(s) for s in files.values())
    # puts: the warmup fills every block after a miss
    assert run_cli("fsclient.cli", *warmup_args(root, key_file, daemon)).returncode == 0
    daemon.wait_idle()
    # touches: a reader then reads dir0 from the cache
    dir0 = {p: s for p, s in files.items() if p.startswith("dir0/")}
    with Volume(VOLUME, str(root), str(key_file), socket_path=daemon.socket_path,
                block_size=BLOCK, memory_cache_bytes=0) as vol:
        deadline = time.monotonic() + 10
        while not vol.stats()["daemon_connected"] and time.monotonic() < deadline:
            time.sleep(0.02)
        for rel, size in dir0.items():
            vol.read(rel, 0, size)
        assert vol.wait_fills()
        reported = vol.stats()["hits"]
    hits = sum(blocks_of(s) for s in dir0.values())
    assert reported == hits
    s = daemon.wait_stats(lambda s: s["volumes"][VOLUME]["touches"] == hits)

    r = cli(daemon)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(VOLUME + " "))
    ratio = f"{100 * hits / (hits + nblocks):.1f}%"
    assert row.split()[:7] == [VOLUME, str(nblocks), *row.split()[2:4], "-", str(hits),
                               str(nblocks)] and ratio in row, row  # "-": no quota
    assert "hit ratio = hits / (hits + puts)" in r.stdout
    dir_row = next(line for line in r.stdout.splitlines() if line.startswith(daemon.cache_dirs[0]))
    assert " ok " in dir_row and "kept under 98%, trimmed to 95%" in dir_row

    r = cli(daemon, "--json")
    data = json.loads(r.stdout)
    assert "id" not in data and "ok" not in data
    assert data["volumes"] == s["volumes"] and set(data) == set(s) - {"id", "ok"}


def _sigint_as_at_a_shell() -> None:
    """SIGINT default and unblocked in the child, as a shell starts a command:
    the suite's process may carry an ignored or blocked SIGINT (set at the C
    level by an extension), which exec would hand down."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_watch_repeats_until_ctrl_c(daemon):
    proc = subprocess.Popen([sys.executable, "-m", "blockcache_client.cli", "--socket",
                             daemon.socket_path, "stats", "--watch", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            cwd=REPO, stdin=subprocess.DEVNULL, preexec_fn=_sigint_as_at_a_shell)
    try:
        seen = []
        deadline = time.monotonic() + 60
        while sum(line.startswith("blockcached at") for line in seen) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            seen.append(proc.stdout.readline())
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=20)
        out = "".join(seen) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "\x1b[" not in out  # not a terminal: plain blocks, no screen control
    assert len(re.findall(r"^blockcached at .*Ctrl-C to stop", out, re.M)) >= 3
    assert out.count("entries      0") >= 2  # the last block may be cut by the Ctrl-C
    assert "Traceback" not in err
