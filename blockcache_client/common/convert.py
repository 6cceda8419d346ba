"""Config values, checked one way for the daemon and fsclient alike.

Each converter takes a raw value (a TOML value, or a flag's string) and
`what` (the key or flag, named in the error) and returns the checked value
or raises ConfigError saying what is wrong and what to give instead. Both
config loaders build on these, so `"64M"`, `"20ms"`, `"0660"` and `true`
mean the same everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..contract.errors import ConfigError
from ..contract.units import parse_duration, parse_size

__all__ = ["address", "boolean", "choice", "count", "duration", "mode", "parse_addr", "path",
           "ratio", "size", "string"]


def size(value: Any, what: str) -> int:
    """Bytes: an integer or `512M`, `10G`, `4MiB`."""
    return parse_size(value, what)


def duration(value: Any, what: str, *, allow_zero: bool = False) -> float:
    """Seconds: a number or `20ms`, `5s`, `2m`; more than 0 unless `allow_zero`."""
    seconds = parse_duration(value, what)
    if not allow_zero and seconds <= 0:
        raise ConfigError(f"{what}: must be more than 0 seconds")
    return seconds


def count(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    """A whole number in lo..hi (an integer, or a flag's digits)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: {value!r} is not a whole number")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: {value!r} is not a whole number") from None
    if isinstance(value, float) and value != n:
        raise ConfigError(f"{what}: {value!r} is not a whole number")
    if n < lo or (hi is not None and n > hi):
        bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"{what}: {value!r} must be in {bounds}")
    return n


def ratio(value: Any, what: str) -> float:
    """A share in (0, 1]."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: {value!r} is not a number between 0 and 1")
    try:
        r = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: {value!r} is not a number between 0 and 1") from None
    if not 0.0 < r <= 1.0:
        raise ConfigError(f"{what}: {value!r} must be in (0, 1]")
    return r


def boolean(value: Any, what: str) -> bool:
    """true or false (a TOML boolean, or that word from a flag)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{what}: {value!r} must be true or false")


def choice(*options: str) -> Callable[[Any, str], str]:
    """A converter accepting one of `options` (any case)."""
    def check(value: Any, what: str) -> str:
        v = str(value).lower()
        if v not in options:
            raise ConfigError(f"{what}: {value!r} is not one of {', '.join(options)}")
        return v
    return check


def string(value: Any, what: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what}: {value!r} must be a non-empty string")
    return value


def path(value: Any, what: str) -> str:
    """A non-empty path, made absolute (the process may chdir later)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what}: must be a non-empty path")
    return os.path.abspath(value)


def mode(value: Any, what: str) -> int:
    """A permission mode: `"0660"` (octal text) or an integer."""
    try:
        m = int(value, 8) if isinstance(value, str) else int(value)
    except ValueError:
        raise ConfigError(f"{what}: {value!r} is not an octal mode like 0660") from None
    if not 0 <= m <= 0o777:
        raise ConfigError(f"{what}: {value!r} is not a permission mode (0..0777)")
    return m


def parse_addr(text: str, what: str = "metrics_addr") -> tuple[str, int]:
    """`HOST:PORT` (or `[v6]:PORT`, or `:PORT` for every address) -> (host, port)."""
    if not isinstance(text, str):
        raise ConfigError(f"{what}: {text!r} must be a string like 127.0.0.1:9101")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what}: {text!r} is not HOST:PORT, e.g. 127.0.0.1:9101 "
                          f"(or :9101 for every address)")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def address(value: Any, what: str) -> str | None:
    """HOST:PORT, or None for "" (off)."""
    if value in ("", None):
        return None
    parse_addr(value, what)
    return value
