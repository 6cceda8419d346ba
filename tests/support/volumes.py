"""`Volume`s on a test source and a real daemon, and their blocks on the disk.

`volume` opens a reader of small blocks (BS) by default, so multi-block files
stay small; the chunk tests pass their own block size. `connected_volume`
opens one by name and local path, its memory LRU off.
"""

from __future__ import annotations

from typing import Any

from blockcache_client import Volume
from blockcache_client.contract.blockfile import HEADER_SIZE
from blockcache_client.contract.layout import Layout
from devtools.daemon import DaemonProcess
from tests.support.waiting import wait_for

BS = 64 << 10  # the smallest block size fsclient accepts: multi-block files stay small


def volume(source, key_file, daemon=None, **kw):
    kw.setdefault("block_size", BS)
    sock = daemon.socket_path if daemon is not None else kw.pop("socket_path", "/nonexistent.sock")
    return Volume("vol", source.url, key_file, socket_path=sock, **kw, **source.options)


def wait_connected(vol):
    wait_for(lambda: vol.stats()["daemon_connected"], what="the volume to reach the daemon")


def settle(vol, daemon, timeout: float = 10):
    """Wait until every fill this volume queued is written by the daemon."""
    assert vol.wait_fills(timeout)
    daemon.wait_idle()


def block_key(vol, rel: str, boff: int = 0, info=None) -> str:
    """The block key of `rel`'s block at `boff`, as the reader names it."""
    info = info or vol.stat(rel)
    return (vol.names.file_prefix(vol.name, info.path, info.version, vol.block_size)
            + format(boff, "016x"))


def cached_block_path(vol, daemon, rel, boff=0):
    key = block_key(vol, rel, boff)
    layout = Layout.from_wire(daemon.client().hello()["layout"])
    return key, layout.path(key)


def fill(vol, daemon, rel, data):
    wait_connected(vol)
    assert vol.read(rel, 0, len(data)) == data
    settle(vol, daemon)


def damage_block(path: str, where: str) -> None:
    """Corrupt a cached block file in place, as a bad disk would: a flipped bit
    in its `header` (the salt: wrong subkey), `body` or `tag`, or the file
    `truncate`d or `extend`ed."""
    blob = bytearray(open(path, "rb").read())
    if where == "header":
        blob[20] ^= 0x01
    elif where == "body":
        blob[HEADER_SIZE + 100] ^= 0x40
    elif where == "tag":
        blob[-3] ^= 0x80
    elif where == "truncate":
        blob = blob[:-100]
    elif where == "extend":
        blob += b"\0" * 16
    else:
        raise ValueError(f"damage_block: unknown place {where!r}")
    with open(path, "r+b" if where != "truncate" else "wb") as f:
        f.write(blob)


def connected_volume(name: str, source: str, key_file: str, daemon: DaemonProcess,
                     **kw: Any) -> Volume:
    """A `Volume` (memory LRU off: every read asks the cache disk or the
    source) that has reached the daemon."""
    kw.setdefault("block_size", BS)
    kw.setdefault("memory_cache_bytes", 0)
    vol = Volume(name, source, key_file, socket_path=daemon.socket_path, **kw)
    try:
        wait_connected(vol)
    except BaseException:
        vol.close()
        raise
    return vol


def fill_files(vol, daemon: DaemonProcess, files: dict[str, bytes]) -> Layout:
    """Read every file once (checked) and wait until the fills are on disk;
    returns the daemon's layout."""
    for rel, data in files.items():
        assert vol.read(rel, 0, len(data)) == data
    assert vol.wait_fills(10)
    daemon.wait_idle()
    return Layout.from_wire(daemon.client().hello()["layout"])
