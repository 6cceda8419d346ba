"""MountConfig from TOML + flags: precedence, prefix TTLs, validation."""

from __future__ import annotations

import pytest

from blockcache_client.contract.errors import ConfigError
from fsclient.config import TtlPolicy, build_config, load_toml, parse_dir_ttl_flag, split_options

BASE = {"volume": "imagenet", "source": "s3://b/p", "mountpoint": "/mnt/x", "key_file": "/k"}

EXAMPLE = '''
volume = "imagenet"
source = "s3://bucket/prefix"
mountpoint = "/mnt/imagenet"
key_file = "/etc/blockcache/keys/imagenet.key"
socket = "/run/blockcache/blockcached.sock"
block_size = "4M"
meta_ttl = 60.0
allow_other = false
readahead_blocks = 2
[dir_ttl]
"code/" = 0
"notebooks/" = 0
[storage_options]
endpoint_url = "http://127.0.0.1:9000"
'''


def test_the_documented_example_loads(tmp_path):
    p = tmp_path / "imagenet.toml"
    p.write_text(EXAMPLE)
    cfg = build_config(load_toml(str(p)))
    assert cfg.volume == "imagenet" and cfg.block_size == 4 << 20
    assert cfg.socket == "/run/blockcache/blockcached.sock"
    assert dict(cfg.storage_options) == {"endpoint_url": "http://127.0.0.1:9000"}
    assert cfg.ttl.ttl_for("code/a.py") == 0
    assert cfg.ttl.ttl_for("code") == 0
    assert cfg.ttl.ttl_for("train/0001.jpg") == 60
    assert "allow_other" not in cfg.fuse_options() and "ro" in cfg.fuse_options()
    assert cfg.max_nodes == 50_000 == build_config(BASE).max_nodes
    assert build_config(BASE, max_nodes=2000).max_nodes == 2000


def test_flags_override_the_file():
    cfg = build_config(dict(BASE, meta_ttl=60, dir_ttl={"code/": 0}),
                       meta_ttl=5.0, block_size="1M", dir_ttl=[("code/", 2.0), ("nb", 0.0)],
                       options=("allow_other,noexec",), source=None)
    assert cfg.meta_ttl == 5.0 and cfg.block_size == 1 << 20
    assert cfg.source == "s3://b/p"  # a flag not given keeps the file's value
    assert cfg.ttl.ttl_for("code/x") == 2.0 and cfg.ttl.ttl_for("nb/y") == 0.0
    assert cfg.allow_other and "allow_other" in cfg.fuse_options()
    assert "noexec" in cfg.fuse_options()


def test_longest_prefix_wins_and_prefixes_are_directories():
    p = TtlPolicy.build(30, {"data/": 10, "/data/hot": 0, "code": 1})
    assert p.ttl_for("data/x") == 10
    assert p.ttl_for("data/hot/x") == 0 and p.ttl_for("data/hot") == 0
    assert p.ttl_for("data/hotter/x") == 10  # "data/hot" is a directory, not a string prefix
    assert p.ttl_for("codebase/x") == 30 and p.ttl_for("code/x") == 1
    assert p.ttl_for("") == 30
    assert TtlPolicy.build(30, {"/": 5}).ttl_for("any/thing") == 5


@pytest.mark.parametrize("bad, words", [
    ({"volume": "Bad_Name"}, "volume name"),
    ({"block_size": "3K"}, "block_size"),
    ({"block_size": "lots"}, "not a size"),
    ({"meta_ttl": -1}, "meta_ttl"),
    ({"meta_ttl": "soon"}, "meta_ttl"),
    ({"dir_ttl": {"a/": "x"}}, "dir_ttl"),
    ({"allow_other": "yes"}, "allow_other"),
    ({"readahead_blocks": 1000}, "readahead_blocks"),
    ({"max_nodes": 10}, "max_nodes"),
    ({"max_nodes": "many"}, "max_nodes"),
    ({"options": ["rw"]}, "not allowed"),
    ({"options": "allow_other"}, "options"),
    ({"storage_options": 3}, "storage_options"),
])
def test_invalid_values_are_errors_that_name_the_key(bad, words):
    with pytest.raises(ConfigError, match=words):
        build_config(dict(BASE, **bad))


def test_missing_required_settings_say_how_to_give_them():
    for key, hint in (("volume", "--volume"), ("source", "SOURCE"), ("mountpoint", "MOUNTPOINT"),
                      ("key_file", "--key-file")):
        data = {k: v for k, v in BASE.items() if k != key}
        with pytest.raises(ConfigError, match=hint):
            build_config(data)


def test_unknown_keys_and_bad_files_are_errors(tmp_path):
    p = tmp_path / "v.toml"
    p.write_text('volume = "v"\nmeta_tll = 3\n')
    with pytest.raises(ConfigError, match="unknown key.*meta_tll"):
        load_toml(str(p))
    p.write_text("volume = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(str(p))
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(str(tmp_path / "missing.toml"))


def test_flag_parsers():
    assert parse_dir_ttl_flag("code/=0") == ("code/", 0.0)
    assert parse_dir_ttl_flag("a=b/=2.5") == ("a=b/", 2.5)
    for bad in ("code", "code/=soon"):
        with pytest.raises(ConfigError, match="--dir-ttl"):
            parse_dir_ttl_flag(bad)
    assert split_options(["a,b", " c ", ""]) == ("a", "b", "c")
    # a comma inside double quotes stays (an SELinux level's categories)
    assert split_options(['ro,context="u:r:t:s0:c1,c2",noatime']) == (
        "ro", 'context="u:r:t:s0:c1,c2"', "noatime")


def test_config_is_frozen():
    cfg = build_config(BASE)
    with pytest.raises(AttributeError):
        cfg.volume = "other"
    with pytest.raises(TypeError):
        cfg.storage_options["x"] = 1


def test_keygen_writes_a_private_key_and_never_overwrites(tmp_path):
    from blockcache_client.volumekey import load_key_file
    from tests.support.fsclient_mounts import fsclient

    path = tmp_path / "v.key"
    res = fsclient("keygen", str(path))
    assert res.returncode == 0, res.stderr
    assert (path.stat().st_mode & 0o777) == 0o400
    key = load_key_file(str(path))
    res = fsclient("keygen", str(path))
    assert res.returncode == 1 and "already exists" in res.stderr
    assert load_key_file(str(path)) == key


def test_a_relative_key_file_is_recorded_absolute(tmp_path, monkeypatch):
    # the mount publishes its config for `fsclient warmup --mount`, which may
    # run from any directory
    monkeypatch.chdir(tmp_path)
    cfg = build_config({**BASE, "key_file": "keys/vol.key"})
    assert cfg.key_file == str(tmp_path / "keys" / "vol.key")


def test_queue_and_memory_keys_are_spelled_as_the_daemon_and_volume_spell_them(tmp_path, caplog):
    p = tmp_path / "v.toml"
    p.write_text('memory_cache_bytes = "8M"\nfill_queue_bytes = "32M"\n')
    cfg = build_config(load_toml(str(p)), **BASE)
    assert (cfg.memory_cache_bytes, cfg.fill_queue_bytes) == (8 << 20, 32 << 20)
    # the old spellings still work, with a warning that names the new key
    p.write_text('memory_cache = "8M"\nfill_queue = "32M"\n')
    with caplog.at_level("WARNING", logger="blockcache.config"):
        cfg = build_config(load_toml(str(p)), **BASE)
    assert (cfg.memory_cache_bytes, cfg.fill_queue_bytes) == (8 << 20, 32 << 20)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "'memory_cache' is deprecated; call it 'memory_cache_bytes'" in warned
    assert "'fill_queue' is deprecated; call it 'fill_queue_bytes'" in warned
    p.write_text('fill_queue = "32M"\nfill_queue_bytes = "64M"\n')
    with pytest.raises(ConfigError, match="'fill_queue' and 'fill_queue_bytes' are the same"):
        load_toml(str(p))


def test_server_user_and_groups_are_numbers_and_never_root():
    cfg = build_config(dict(BASE, server_user="65534:65534", server_groups=[10001, 10001]))
    assert (cfg.server_user.uid, cfg.server_user.gid, cfg.server_user.groups) == \
        (65534, 65534, (10001,))
    assert build_config(BASE).server_user is None
    for bad, words in (("nobody", "UID:GID"), ("0:0", "root"), ("65534", "UID:GID")):
        with pytest.raises(ConfigError, match=words):
            build_config(dict(BASE, server_user=bad))
    with pytest.raises(ConfigError, match="needs server_user"):
        build_config(dict(BASE, server_groups=[1]))
    with pytest.raises(ConfigError, match="list of gids"):
        build_config(dict(BASE, server_user="1:1", server_groups=5))


def test_a_mount_is_read_only_unless_writable(tmp_path):
    assert not build_config(BASE).writable and "ro" in build_config(BASE).fuse_options()
    p = tmp_path / "ckpt.toml"
    p.write_text('volume = "ckpt"\nsource = "s3://b/ckpt"\nmountpoint = "/mnt/c"\n'
                 'key_file = "/k"\nwritable = true\nstaging_dir = "/scratch"\n'
                 'staging_bytes = "64G"\nwrite_access = "all"\n')
    cfg = build_config(load_toml(str(p)))
    assert cfg.writable and "ro" not in cfg.fuse_options()
    assert "default_permissions" in cfg.fuse_options()
    assert (cfg.staging_dir, cfg.staging_bytes, cfg.write_access) == ("/scratch", 64 << 30,
                                                                        "all")
    flags = build_config(BASE, writable=True, staging_bytes="1G")
    assert flags.writable and flags.staging_bytes == 1 << 30 and flags.write_access == "owner"
    with pytest.raises(ConfigError, match="write_access 'everyone'.*owner.*all"):
        build_config(BASE, write_access="everyone")
    with pytest.raises(ConfigError, match="writable"):
        build_config(dict(BASE, writable="maybe"))
