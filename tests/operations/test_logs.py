"""--log-format json: both programs write one JSON object per line."""

from __future__ import annotations

import json

from devtools.daemon import DaemonProcess
from tests.support.cli_runs import run_cli, warmup_args


def json_lines(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines
    entries = [json.loads(line) for line in lines]  # every line parses on its own
    for e in entries:
        assert {"time", "level", "logger", "message"} <= set(e), e
        assert e["level"] in ("debug", "info", "warning", "error")
    return entries


def test_daemon_and_fsclient_json_logs(tmp_path, tree, key_file):
    root, _ = tree
    d = DaemonProcess(tmp_path, extra_args=["--log-format", "json", "--log-level", "debug"])
    try:
        d.start()
        d.wait_rebuilt()
        r = run_cli("fsclient.cli", "--log-format", "json", "--log-level", "debug",
                    *warmup_args(root, key_file, d))
        assert r.returncode == 0, r.stderr
        fs_logs = json_lines(r.stderr)
        assert any(e["logger"] == "blockcache_client.daemonclient.link" for e in fs_logs)
    finally:
        d.stop()
    daemon_logs = json_lines(d.stderr())
    assert any("serving on" in e["message"] for e in daemon_logs)
    assert any(e["level"] == "debug" for e in daemon_logs + fs_logs)


def test_text_logs_by_default(daemon, tree, key_file):
    root, _ = tree
    r = run_cli("fsclient.cli", *warmup_args(root, key_file, daemon, "--check"))
    assert r.returncode == 0
    assert " INFO blockcache_client.daemonclient.link: connected" in r.stderr
    assert not r.stderr.lstrip().startswith("{")
