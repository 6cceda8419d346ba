"""The config converters the daemon and fsclient share: one meaning per value."""

from __future__ import annotations

import pytest

from blockcache_client.common import convert
from blockcache_client.contract.errors import ConfigError


@pytest.mark.parametrize("raw, seconds", [
    (2, 2.0), (2.5, 2.5), ("2.5", 2.5), ("20ms", 0.02), ("5s", 5.0), ("2m", 120.0),
    ("1h", 3600.0), (" 30S ", 30.0),
])
def test_duration_units(raw, seconds):
    assert convert.duration(raw, "timeout") == pytest.approx(seconds)


@pytest.mark.parametrize("raw", ["soon", "-1", -1, "5 days", True, float("inf"), float("nan")])
def test_duration_refuses_what_is_not_one(raw):
    with pytest.raises(ConfigError, match="timeout"):
        convert.duration(raw, "timeout")


def test_duration_zero_only_where_allowed():
    assert convert.duration("0", "meta_ttl", allow_zero=True) == 0
    with pytest.raises(ConfigError, match="more than 0"):
        convert.duration(0, "io_timeout")


@pytest.mark.parametrize("raw, n", [(3, 3), ("3", 3), (3.0, 3)])
def test_count(raw, n):
    assert convert.count(raw, "threads", 1, 8) == n


@pytest.mark.parametrize("raw", [True, "x", 2.5, 0, 9, "-1"])
def test_count_refuses(raw):
    with pytest.raises(ConfigError, match="threads"):
        convert.count(raw, "threads", 1, 8)


def test_boolean_takes_true_and_false_only():
    assert convert.boolean(True, "a") is True and convert.boolean("False", "a") is False
    for raw in ("yes", 1, None):
        with pytest.raises(ConfigError, match="true or false"):
            convert.boolean(raw, "allow_other")


def test_sizes_modes_addresses():
    assert convert.size("64M", "fill_queue_bytes") == 64 << 20
    assert convert.mode("0640", "socket_mode") == 0o640
    assert convert.address("127.0.0.1:9101", "metrics_addr") == "127.0.0.1:9101"
    assert convert.address("", "metrics_addr") is None
    assert convert.parse_addr("[::1]:11211", "memcached") == ("::1", 11211)
    for conv, raw in ((convert.size, "lots"), (convert.mode, "0999"),
                      (convert.address, "nohost"), (convert.ratio, 1.5)):
        with pytest.raises(ConfigError, match="the_key"):
            conv(raw, "the_key")
