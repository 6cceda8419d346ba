"""Volume key files: generation, mode checks, malformed content."""

import os
import pwd
import stat
import threading

import pytest

from blockcache_client.contract.blockfile import KEY_SIZE
from blockcache_client.contract.errors import ConfigError
from blockcache_client.volumekey import generate_key_file, load_key_file


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


def test_hex_with_outer_whitespace_accepted(tmp_path):
    raw = os.urandom(KEY_SIZE)
    assert load_key_file(write(tmp_path / "k", b"  " + raw.hex().encode() + b"\r\n\n")) == raw
    assert load_key_file(write(tmp_path / "K", raw.hex().upper().encode())) == raw


def test_hex_with_inner_whitespace_refused(tmp_path):
    # 64 characters, but only 48 hex digits: bytes.fromhex made a 24-byte key of it
    digits = os.urandom(24).hex()
    text = " ".join(digits[i:i + 3] for i in range(0, 48, 3)).encode()  # 63 characters
    text += b" "
    with pytest.raises(ConfigError, match="no spaces inside"):
        load_key_file(write(tmp_path / "k", text + b"\n"))


@pytest.mark.parametrize("data", [b"correct horse battery staple 123",   # 32 ASCII chars
                                  b"\xe2\x82\xac" * 10 + b"ab",           # UTF-8 text
                                  bytes(KEY_SIZE), b"\xff\x00" * 16,      # patterns
                                  b"00" * KEY_SIZE, b"0123456789abcdef" * 4])  # hex patterns
def test_keys_that_are_not_random_refused(tmp_path, data):
    with pytest.raises(ConfigError, match="keygen"):
        load_key_file(write(tmp_path / "k", data))


def test_fifo_is_refused_without_blocking(tmp_path):
    path = tmp_path / "fifo.key"
    os.mkfifo(path, 0o600)
    got: list = []

    def load():
        try:
            got.append(load_key_file(str(path)))
        except ConfigError as exc:
            got.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # release the open(2) the loader is stuck in
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("load_key_file blocked on a FIFO")
    assert isinstance(got[0], ConfigError) and "not a regular file" in str(got[0])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file away")
def test_key_owned_by_someone_else_refused(tmp_path):
    path = tmp_path / "vol.key"
    generate_key_file(str(path))
    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(ConfigError, match=f"owned by uid {nobody.pw_uid}.*chown 0 "):
        load_key_file(str(path))
