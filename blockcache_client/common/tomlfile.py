"""Reading a TOML config file, for the daemon and fsclient alike.

One loader, so both name the file and the problem the same way, refuse
unknown keys (a typo must not silently fall back to a default) and accept a
renamed key's old spelling with a warning that names the new one.
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Collection, Mapping
from typing import Any

from ..contract.errors import ConfigError

log = logging.getLogger("blockcache.config")


def read_toml(path: str, keys: Collection[str],
              renamed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The top-level table of TOML file `path`, holding only `keys`.

    `renamed` maps an old key to its new name: the old one is accepted as the
    new one, with a warning; both at once is an error. Raises ConfigError."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for old, new in (renamed or {}).items():
        if old not in data:
            continue
        if new in data:
            raise ConfigError(f"config file {path}: {old!r} and {new!r} are the same setting; "
                              f"keep {new!r} only")
        log.warning("config file %s: %r is deprecated; call it %r", path, old, new)
        data[new] = data.pop(old)
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(unknown)}; "
                          f"valid keys are {', '.join(sorted(keys))}")
    return data
