"""The names users import from `blockcache_client`: pinned, so a rename is a visible decision."""

from __future__ import annotations

import subprocess
import sys

import blockcache_client
from blockcache_client import volumekey
from blockcache_client.contract import blockfile, blockkey, errors
from blockcache_client.daemonclient import asyncclient, client
from blockcache_client.reader import volume

PUBLIC = [
    "AsyncClient", "BlockKey", "BlockcacheError", "BlockcachedFileSystem", "Client",
    "ConfigError", "DaemonError", "DaemonUnavailable", "FileInfo", "FormatError",
    "IntegrityError", "InvalidKey", "ProtocolError", "Volume", "VolumeFile",
    "default_socket", "generate_key_file", "load_key_file", "prefetch_ahead", "seal",
    "unseal",
]


def test_the_public_names_are_pinned():
    assert blockcache_client.__all__ == PUBLIC
    assert set(PUBLIC) <= set(dir(blockcache_client))


def test_each_public_name_is_the_object_its_module_defines():
    from blockcache_client import AsyncClient, BlockKey, Client, Volume, seal, unseal
    assert (Volume, Client, AsyncClient) == (volume.Volume, client.Client, asyncclient.AsyncClient)
    assert (BlockKey, seal, unseal) == (blockkey.BlockKey, blockfile.seal, blockfile.unseal)
    assert blockcache_client.generate_key_file is volumekey.generate_key_file
    for name in PUBLIC:
        obj = getattr(blockcache_client, name)
        assert obj.__module__.startswith("blockcache_client."), name
    assert issubclass(blockcache_client.DaemonUnavailable, errors.BlockcacheError)


def test_an_unknown_name_is_an_attribute_error():
    try:
        blockcache_client.Volumes  # noqa: B018
    except AttributeError as exc:
        assert "Volumes" in str(exc)
    else:
        raise AssertionError("blockcache_client.Volumes resolved")


def test_the_contract_loads_without_the_reader():
    # the daemon imports contract modules only: the package must not drag in
    # the reader, fsspec or botocore with them
    code = ("import sys, blockcache_client.contract.blockkey, "
            "blockcache_client.contract.blockfile; "
            "print(sorted(m for m in ('blockcache_client.reader.volume', 'fsspec', 'botocore') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"
