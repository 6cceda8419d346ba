"""blockcache client library: the contract (keys, block file format, wire
protocol, on-disk layout) and everything a reader needs on top of it.

The public names are importable from here (`from blockcache_client import
Volume`); `__all__` lists them. They load on first use, so the daemon, which
imports only the contract modules (`keys`, `blockfile`, `protocol`, `wire`,
`layout`, `units`, `errors`), does not load the reader, fsspec or botocore.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    # reading a volume
    "Volume": "reader.volume",
    "VolumeFile": "reader.volumefile",
    "FileInfo": "backend",
    "BlockcachedFileSystem": "fsspec_fs",
    # volume keys
    "generate_key_file": "keyfile",
    "load_key_file": "keyfile",
    # talking to the daemon
    "Client": "client",
    "AsyncClient": "client",
    "default_socket": "protocol",
    # the contract: block keys and sealed block files
    "BlockKey": "keys",
    "seal": "blockfile",
    "unseal": "blockfile",
    # errors
    "BlockcacheError": "errors",
    "ConfigError": "errors",
    "DaemonError": "errors",
    "DaemonUnavailable": "errors",
    "FormatError": "errors",
    "IntegrityError": "errors",
    "InvalidKey": "errors",
    "ProtocolError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
