"""`fsclient warmup`: warm, check, evict, resume, file lists, through the real CLI
and a real blockcached."""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess
import sys
import time

import pytest

from blockcache_client import Volume
from blockcache_client.contract.blockkey import KeyNamer
from blockcache_client.volumekey import load_key_file
from tests.support.cli_runs import BLOCK, VOLUME, blocks_of, run_cli, warmup_args
from tests.support.fsclient_mounts import REPO, env


def volume_keys(daemon) -> set[str]:
    return set(daemon.client().list_all(VOLUME))


def check_report(out: str) -> tuple[dict[str, tuple[float, str]], float]:
    """{given path: (percent, line)} and the total percent from --check output."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+.*files\s+(\S+)$", line)
        if m:
            rows[m.group(2)] = (float(m.group(1)), line)
    total = re.search(r"total: ([\d.]+)% cached", out)
    assert total, out
    return rows, float(total.group(1))


def test_warmup_then_reads_are_all_hits(daemon, tree, key_file):
    root, files = tree
    daemon.wait_rebuilt()
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon))
    assert r.returncode == 0, r.stdout + r.stderr
    nblocks = sum(blocks_of(s) for s in files.values())
    assert f"{len(files)} files" in r.stdout
    assert "fetched" in r.stdout and f"({nblocks} blocks" in r.stdout, r.stdout
    assert "links skipped   1" in r.stdout  # the tree's one symlink is not followed
    daemon.wait_idle()
    assert len(volume_keys(daemon)) == nblocks

    with Volume(VOLUME, str(root), str(key_file), socket_path=daemon.socket_path,
                block_size=BLOCK) as vol:
        deadline = time.monotonic() + 10
        while not vol.stats()["daemon_connected"] and time.monotonic() < deadline:
            time.sleep(0.02)
        for rel, size in files.items():
            assert vol.read(rel, 0, size) == (root / rel).read_bytes()
        s = vol.stats()
    assert s["misses"] == 0 and s["backend_requests"] == 0, s
    assert s["hits"] == sum(blocks_of(size) for size in files.values())


def test_check_percentages_before_partial_after(daemon, tree, key_file):
    root, files = tree
    daemon.wait_rebuilt()
    total = sum(files.values())
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "--check", "dir0", "dir1"))
    assert r.returncode == 0, r.stderr
    rows, pct = check_report(r.stdout)
    assert rows["dir0"][0] == 0.0 and rows["dir1"][0] == 0.0 and pct == 0.0

    # warm dir1 and one file of dir0: exactly those bytes are cached
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "dir1", "dir0/f6.bin"))
    assert r.returncode == 0, r.stdout + r.stderr
    daemon.wait_idle()
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "--check", "dir0", "dir1",
                                             "dir0/f6.bin", "missing.bin"))
    assert r.returncode == 1  # one path does not exist
    assert "missing.bin: not found" in r.stdout
    rows, pct = check_report(r.stdout)
    dir0 = sum(s for p, s in files.items() if p.startswith("dir0/"))
    assert rows["dir1"][0] == 100.0
    assert rows["dir0/f6.bin"][0] == 100.0
    assert abs(rows["dir0"][0] - 100.0 * files["dir0/f6.bin"] / dir0) < 0.1, rows["dir0"]

    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "--check"))
    _, pct = check_report(r.stdout)
    warm = sum(s for p, s in files.items() if p.startswith("dir1/")) + files["dir0/f6.bin"]
    assert abs(pct - 100.0 * warm / total) < 0.1

    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon))
    assert r.returncode == 0
    assert "already cached" in r.stdout
    daemon.wait_idle()
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "--check"))
    _, pct = check_report(r.stdout)
    assert pct == 100.0


def test_evict_removes_exactly_those_blocks(daemon, tree, key_file):
    root, files = tree
    daemon.wait_rebuilt()
    assert run_cli("fsclient.cli", *warmup_args(root, key_file, daemon)).returncode == 0
    daemon.wait_idle()
    before = volume_keys(daemon)
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "--evict", "dir0",
                                             "dir2/sub/f1.bin"))
    assert r.returncode == 0, r.stdout + r.stderr
    gone = [p for p in files if p.startswith("dir0/")] + ["dir2/sub/f1.bin"]
    names = KeyNamer(load_key_file(str(key_file)))
    prefixes = tuple(f"{VOLUME}_{names.inode(p)}_" for p in gone)
    expected_gone = {k for k in before if k.startswith(prefixes)}
    assert expected_gone and len(expected_gone) == sum(blocks_of(files[p]) for p in gone)
    assert f"evicted {len(expected_gone)} blocks" in r.stdout
    assert volume_keys(daemon) == before - expected_gone


@pytest.mark.timeout(300)
def test_file_list_with_many_entries(daemon, tmp_path, key_file):
    root = tmp_path / "many"
    n = 3000
    for i in range(n):
        d = root / f"d{i % 30}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_bytes(b"x" * (i % 700 + 1))
    listing = tmp_path / "list.txt"
    with open(listing, "w") as f:
        f.write("# comment lines and blank lines are skipped\n\n")
        for i in range(n):
            f.write(f"d{i % 30}/f{i}\n")
        f.write("d0/not-there\n")
    daemon.wait_rebuilt()
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "-f", str(listing), "-p", "8"),
                timeout=110)
    assert r.returncode == 1, r.stdout + r.stderr  # the missing entry fails the run ...
    assert f"{n} files" in r.stdout
    assert f"({n} blocks" in r.stdout
    assert "failed          1 path" in r.stdout and "d0/not-there: not found" in r.stdout
    # every block file is written before the check: slow on small disks
    daemon.wait_idle(timeout=150)
    assert len(volume_keys(daemon)) == n  # ... and every other entry is cached


def test_interrupted_warmup_resumes_without_refetching(daemon, tree, key_file, tmp_path):
    root, files = tree
    nblocks = sum(blocks_of(s) for s in files.values())
    config = tmp_path / "slow.toml"
    # each source request takes 0.15 s, so SIGINT lands mid-run
    config.write_text(f'volume = "{VOLUME}"\nsource = "latency::file://{root}"\n'
                      f'key_file = "{key_file}"\nsocket = "{daemon.socket_path}"\n'
                      f'block_size = {BLOCK}\n[storage_options]\nlatency = {{delay = 0.15}}\n')
    daemon.wait_rebuilt()
    args = [sys.executable, "-m", "fsclient.cli", "warmup", "--config", str(config), "-p", "2",
            "--progress-interval", "0.2"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        daemon.wait_stats(lambda s: s["puts"] >= 3, timeout=60)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out + err
    assert "warmup interrupted (SIGINT)" in out
    assert re.search(r"^warmup \[listing\.\.\.\] files \d+", err, re.M), err  # plain progress lines
    first = int(re.search(r"fetched .*\((\d+) blocks", out).group(1))
    assert 3 <= first < nblocks, out
    s = daemon.wait_idle()
    assert s["puts"] == first  # every block fetched before the interrupt was handed over

    r = run_cli("fsclient.cli", "warmup", "--config", str(config), "-p", "4", timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    second = int(re.search(r"fetched .*\((\d+) blocks", r.stdout).group(1))
    cached = int(re.search(r"already cached .*\((\d+) blocks", r.stdout).group(1))
    assert cached == first and first + second == nblocks, r.stdout
    s = daemon.wait_idle()
    # every block was put exactly once over both runs: nothing was fetched twice
    assert s["puts"] == nblocks and s["put_results"] == {"queued": nblocks}
    assert len(volume_keys(daemon)) == nblocks


def test_progress_bar_on_a_terminal(daemon, tree, key_file, tmp_path):
    root, files = tree
    config = tmp_path / "slow.toml"
    config.write_text(f'volume = "{VOLUME}"\nsource = "latency::file://{root}"\n'
                      f'key_file = "{key_file}"\nsocket = "{daemon.socket_path}"\n'
                      f'block_size = {BLOCK}\n[storage_options]\nlatency = {{delay = 0.05}}\n')
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "fsclient.cli", "--log-level", "warning",
                             "warmup", "--config", str(config), "-p", "1"],
                            stdout=subprocess.PIPE, stderr=slave, env=env(), cwd=REPO,
                            stdin=subprocess.DEVNULL)
    os.close(slave)
    tty = b""
    try:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            tty += chunk
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + tty.decode(errors="replace")
    assert b"\r\x1b[Kwarmup [" in tty  # redrawn in place
    assert b"\n" not in tty.replace(b"\r\n", b"")  # no scrolling lines
    assert "warmup done" in out and f"{len(files)} files" in out
