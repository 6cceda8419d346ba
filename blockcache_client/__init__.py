"""blockcache client library: the contract (`contract/`: block keys, block file
format, wire protocol, on-disk layout), shared utilities (`common/`) and
everything a reader needs on top of them.

The public names are importable from here (`from blockcache_client import
Volume`); `__all__` lists them. They load on first use, so the daemon, which
imports only `contract` and `common`, does not load the reader, fsspec or
botocore.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    # reading a volume
    "Volume": "reader.volume",
    "VolumeFile": "reader.volumefile",
    "FileInfo": "sources.fileinfo",
    "BlockcachedFileSystem": "fsspec_fs",
    "prefetch_ahead": "reader.prefetchahead",
    # volume keys
    "generate_key_file": "volumekey",
    "load_key_file": "volumekey",
    # talking to the daemon
    "Client": "daemonclient.client",
    "AsyncClient": "daemonclient.asyncclient",
    "default_socket": "contract.protocol",
    # the contract: block keys and sealed block files
    "BlockKey": "contract.blockkey",
    "seal": "contract.blockfile",
    "unseal": "contract.blockfile",
    # errors
    "BlockcacheError": "contract.errors",
    "ConfigError": "contract.errors",
    "DaemonError": "contract.errors",
    "DaemonUnavailable": "contract.errors",
    "FormatError": "contract.errors",
    "IntegrityError": "contract.errors",
    "InvalidKey": "contract.errors",
    "ProtocolError": "contract.errors",
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
