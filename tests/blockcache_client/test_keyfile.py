"""Volume key files: generation, mode checks, malformed content."""

import os
import stat

import pytest

from blockcache_client.blockfile import KEY_SIZE
from blockcache_client.errors import ConfigError
from blockcache_client.keyfile import generate_key_file, load_key_file


def test_generate_and_load(tmp_path):
    path = tmp_path / "vol.key"
    generate_key_file(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    key = load_key_file(str(path))
    assert len(key) == KEY_SIZE
    other = tmp_path / "other.key"
    generate_key_file(str(other))
    assert load_key_file(str(other)) != key


def test_never_overwrites(tmp_path):
    path = tmp_path / "vol.key"
    generate_key_file(str(path))
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="already exists"):
        generate_key_file(str(path))
    assert path.read_bytes() == before


@pytest.mark.parametrize("mode", [0o440, 0o404, 0o640, 0o604, 0o420])
def test_group_or_other_access_refused(tmp_path, mode):
    path = tmp_path / "vol.key"
    generate_key_file(str(path))
    os.chmod(path, mode)
    with pytest.raises(ConfigError, match="chmod 0400"):
        load_key_file(str(path))


def test_missing_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="keygen"):
        load_key_file(str(tmp_path / "nope.key"))


def test_directory_refused(tmp_path):
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(ConfigError):
        load_key_file(str(d))


def write(path, data, mode=0o600):
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def test_raw_bytes_accepted(tmp_path):
    raw = os.urandom(KEY_SIZE)
    assert load_key_file(write(tmp_path / "k", raw)) == raw


@pytest.mark.parametrize("data", [b"", b"abc", b"00" * 31 + b"\n", b"zz" * 32 + b"\n",
                                  b"00" * 33 + b"\n", os.urandom(KEY_SIZE + 1)])
def test_malformed_refused(tmp_path, data):
    with pytest.raises(ConfigError, match="does not hold a volume key"):
        load_key_file(write(tmp_path / "k", data))
