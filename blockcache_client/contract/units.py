"""Human sizes and durations for flags and config: `512M`, `10G`, `4MiB`,
`1.5T`, `4096`; `20ms`, `5s`, `2m`, `1h`, `2.5`."""

import re

from .errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_size(text: str | int, what: str = "size") -> int:
    """Parse a byte size; suffixes are binary (`1K` = 1024). Raises ConfigError."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"{what}: {text} is negative; give a size like 512M or 10G")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{what}: {text!r} is not a size; use a number with an "
                          f"optional K/M/G/T suffix, like 512M or 10G")
    number, unit, _ = m.groups()
    return int(float(number) * _MULT[unit.lower()])


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | float, what: str = "duration") -> float:
    """Parse a duration into seconds; a bare number is seconds. Raises ConfigError."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not text >= 0 or text == float("inf"):
            raise ConfigError(f"{what}: {text!r} is not a duration; give seconds >= 0 or "
                              f"a value like 20ms, 5s, 2m")
        return float(text)
    m = _DURATION.match(str(text))
    if not m:
        raise ConfigError(f"{what}: {text!r} is not a duration; use seconds or a number "
                          f"with ms/s/m/h, like 20ms, 5s or 2m")
    number, unit = m.groups()
    return float(number) * _SECONDS[(unit or "s").lower()]


def format_size(n: float) -> str:
    """Format bytes for people: `3.5 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
