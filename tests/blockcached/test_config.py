"""Config: TOML + flags, flags win, everything validated once, unknown keys refused."""

from __future__ import annotations

import grp
import os
import re
import subprocess
import sys

import pytest

from blockcache_client.contract.errors import ConfigError
from blockcached.cli import config_from_args

TOML = """
socket = "/tmp/bc-test/x.sock"
socket_mode = "0640"
socket_group = "0"
admin_gids = [5, "0"]
high_watermark = 0.9
low_watermark = 0.5
min_free_bytes = "2G"
min_free_inodes = 7
max_entries = 100
fill_queue_bytes = "64M"
io_timeout = 2.5
log_level = "debug"
log_format = "json"
[[cache_dirs]]
path = "/tmp/bc-test/a"
size = "100G"
[[cache_dirs]]
path = "/tmp/bc-test/b"
size = "50G"
weight = 3
"""


def cfg_of(tmp_path, toml: str | None, *flags: str):
    argv = list(flags)
    if toml is not None:
        p = tmp_path / "c.toml"
        p.write_text(toml)
        argv = ["--config", str(p)] + argv
    return config_from_args(argv)


def test_file_values(tmp_path):
    c = cfg_of(tmp_path, TOML)
    assert c.socket == "/tmp/bc-test/x.sock" and c.socket_mode == 0o640
    assert c.socket_group == 0 and c.admin_gids == {0, 5}
    assert (c.high_watermark, c.low_watermark) == (0.9, 0.5)
    assert c.min_free_bytes == 2 << 30 and c.min_free_inodes == 7 and c.max_entries == 100
    assert c.fill_queue_bytes == 64 << 20 and c.io_timeout == 2.5
    assert (c.log_level, c.log_format) == ("debug", "json")
    a, b = c.cache_dirs
    assert (a.path, a.size, a.placement_weight) == ("/tmp/bc-test/a", 100 << 30, 100 << 30)
    assert (b.size, b.placement_weight) == (50 << 30, 3)


def test_flags_override_file(tmp_path):
    c = cfg_of(tmp_path, TOML, "--socket", "/tmp/bc-test/y.sock",
               "--cache-dir", "/tmp/bc-test/c:1G",
               "--high-watermark", "0.8", "--admin-gid", "9", "--socket-mode", "0600",
               "--min-free-bytes", "0", "--max-entries", "0")
    assert c.socket == "/tmp/bc-test/y.sock" and c.socket_mode == 0o600
    assert [d.path for d in c.cache_dirs] == ["/tmp/bc-test/c"] and c.cache_dirs[0].size == 1 << 30
    assert c.high_watermark == 0.8 and c.low_watermark == 0.5  # the file's low stays
    assert c.admin_gids == {9} and c.min_free_bytes == 0 and c.max_entries == 0


def test_defaults_and_env_socket(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKCACHE_SOCKET", "/tmp/bc-test/env.sock")
    c = cfg_of(tmp_path, None, "--cache-dir", "rel/dir")
    assert c.socket == "/tmp/bc-test/env.sock"
    assert c.cache_dirs[0].path == os.path.abspath("rel/dir")
    assert c.socket_mode == 0o660 and c.high_watermark == 0.98 and c.low_watermark == 0.95
    assert c.admission_policy == "tinylfu"
    assert c.fill_queue_bytes == 256 << 20 and c.socket_group is None


def test_access_and_limits(tmp_path):
    toml = ('admin_uids = []\nunlisted_volumes = "admin"\nmax_connections_per_uid = 8\n'
            'max_reply_bytes_per_uid = "4M"\nfill_queue_share = 0.25\nmax_volumes = 10\n'
            'max_volumes_per_uid = 3\n'
            '[volumes.imagenet]\nuids = [1000, "root"]\ngids = ["0"]\n'
            '[[cache_dirs]]\npath = "/a"\n')
    c = cfg_of(tmp_path, toml, "--volume-access", "coco=uid:7,gid:8")
    assert c.admin_uids == frozenset() and c.unlisted_volumes == "admin"
    assert (c.max_connections_per_uid, c.max_reply_bytes_per_uid) == (8, 4 << 20)
    assert (c.fill_queue_share, c.max_volumes, c.max_volumes_per_uid) == (0.25, 10, 3)
    assert c.volumes["imagenet"].uids == {1000, 0} and c.volumes["imagenet"].gids == {0}
    assert c.volumes["coco"].uids == {7} and c.volumes["coco"].gids == {8}
    d = cfg_of(tmp_path, None, "--cache-dir", "/a")
    assert d.admin_uids == {0} and d.volumes == {} and d.unlisted_volumes == "open"
    assert d.max_volumes_per_uid == 800
    assert cfg_of(tmp_path, None, "--cache-dir", "/a", "--admin-uid", "").admin_uids == frozenset()


def test_group_by_name(tmp_path):
    name = grp.getgrgid(0).gr_name
    assert cfg_of(tmp_path, None, "--cache-dir", "/tmp/x", "--socket-group", name).socket_group == 0


@pytest.mark.parametrize("toml, flags, words", [
    ('sockett = "/x"\n[[cache_dirs]]\npath = "/a"', (), "unknown key(s) sockett"),
    ('[[cache_dirs]]\npath = "/a"\nsise = "1G"', (), "unknown key(s) sise"),
    ('[[cache_dirs]]\nsize = "1G"', (), "'path' is required"),
    ("", (), "no cache dir configured"),
    ('high_watermark = 0.5\nlow_watermark = 0.6\n[[cache_dirs]]\npath = "/a"', (),
     "below the high"),
    ('high_watermark = 1.5\n[[cache_dirs]]\npath = "/a"', (), "must be in (0, 1]"),
    ('socket_mode = "999"\n[[cache_dirs]]\npath = "/a"', (), "octal mode"),
    ('min_free_bytes = "lots"\n[[cache_dirs]]\npath = "/a"', (), "not a size"),
    ('socket_group = "no-such-group-xyz"\n[[cache_dirs]]\npath = "/a"', (), "no group named"),
    ("not toml [", (), "not valid TOML"),
    (None, ("--cache-dir", "/a", "--cache-dir", "/a/b"), "inside cache dir"),
    (None, ("--cache-dir", "/a", "--log-format", "xml"), "not one of text, json"),
    (None, ("--cache-dir", "/a", "--io-timeout", "0"), "more than 0 seconds"),
    ('[volumes.Bad]\nuids = [0]\n[[cache_dirs]]\npath = "/a"', (), "invalid volume name 'Bad'"),
    ('[volumes.v]\nusers = [0]\n[[cache_dirs]]\npath = "/a"', (), "unknown key(s) users"),
    ('[volumes.v]\nuids = ["no-such-user-xyz"]\n[[cache_dirs]]\npath = "/a"', (), "no user named"),
    ('volumes = 3\n[[cache_dirs]]\npath = "/a"', (), "one per volume"),
    (None, ("--cache-dir", "/a", "--volume-access", "v=user:1"), "not uid:USER or gid:GROUP"),
    (None, ("--cache-dir", "/a", "--volume-access", "v"), "expected VOL=uid:USER"),
    (None, ("--cache-dir", "/a", "--unlisted-volumes", "closed"), "not one of open, admin"),
    (None, ("--cache-dir", "/a", "--fill-queue-share", "0"), "must be in (0, 1]"),
    (None, ("--cache-dir", "/a", "--max-volumes", "0"), "max_volumes must be at least 1"),
])
def test_invalid_config_is_refused_with_a_clear_message(tmp_path, toml, flags, words):
    with pytest.raises(ConfigError) as err:
        cfg_of(tmp_path, toml, *flags)
    assert words in str(err.value)


def test_daemon_refuses_bad_config_at_start(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('cache_dir = "/tmp/x"\n')
    r = subprocess.run([sys.executable, "-m", "blockcached", "--config", str(bad)],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 2
    assert r.stderr.startswith("blockcached: ") and "unknown key(s) cache_dir" in r.stderr
    assert "Traceback" not in r.stderr


def test_volume_quotas(tmp_path):
    c = cfg_of(tmp_path, '[[cache_dirs]]\npath = "/x"\n\n[volumes.imagenet]\nmax_bytes = "2T"\n\n'
                         '[volumes.coco]\nmax_bytes = 1000\n')
    assert c.volume_quotas == (("coco", 1000), ("imagenet", 2 << 40))
    assert cfg_of(tmp_path, '[[cache_dirs]]\npath = "/x"\n').volume_quotas == ()


@pytest.mark.parametrize("table, message", [
    ('[volumes.Big_Name]\nmax_bytes = "1G"', "volumes.Big_Name"),
    ('[volumes.a]\nweight = 2', "unknown key(s) weight"),
    ('[volumes.a]\nmax_bytes = 0', "more than 0"),
    ('[volumes.a]', "an empty table"),
    ('volumes = 3', "must be tables, one per volume"),
])
def test_bad_volume_quotas_are_named(tmp_path, table, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg_of(tmp_path, table + '\n\n[[cache_dirs]]\npath = "/x"\n')
