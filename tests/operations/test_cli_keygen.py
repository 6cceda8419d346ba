"""`blockcache-cli keygen` and `fsclient keygen`: one command, the same key files."""

from __future__ import annotations

import os
import stat

from blockcache_client.volumekey import load_key_file
from tests.support.cli_runs import run_cli


def test_both_tools_write_private_keys_and_never_overwrite(tmp_path):
    keys = {}
    for module, prog in (("blockcache_client.cli", "blockcache-cli"), ("fsclient.cli", "fsclient")):
        path = tmp_path / f"{prog}.key"
        r = run_cli(module, "keygen", str(path))
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"wrote a new volume key to {path}"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
        keys[prog] = load_key_file(str(path))
        before = path.read_bytes()
        again = run_cli(module, "keygen", str(path))
        assert again.returncode == 1 and again.stderr.startswith(f"{prog}: ")
        assert "already exists" in again.stderr and len(again.stderr.splitlines()) == 1
        assert path.read_bytes() == before
    assert keys["blockcache-cli"] != keys["fsclient"]


def test_blockcache_cli_keygen_needs_no_daemon(tmp_path):
    # An operator making a key for fsspec or Volume readers may have no daemon.
    path = tmp_path / "v.key"
    r = run_cli("blockcache_client.cli", "--socket", str(tmp_path / "none.sock"), "keygen",
                str(path))
    assert r.returncode == 0, r.stderr
    assert len(load_key_file(str(path))) == 32


def test_keygen_names_a_missing_directory(tmp_path):
    path = tmp_path / "no" / "such" / "v.key"
    r = run_cli("blockcache_client.cli", "keygen", str(path))
    assert r.returncode == 1
    assert f"cannot create key file {path}" in r.stderr and "Traceback" not in r.stderr
