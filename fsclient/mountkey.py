"""Where a mount's volume key comes from: a server never opens the key file.

Its keeper (root under the CSI plugin) opens the file, or takes `--key-fd N`
from its caller, and sends each server a descriptor of it on their socket
(`keeper.handoff`, "key"; `--key-from-keeper` on the server's command line),
which the server asks for once it is not dumpable. The server reads the key
at offset 0 and keeps the descriptor: the keeper it starts if its own dies
(`keeper.successor`) runs as its uid and gets the key from it the same way.
"""

from __future__ import annotations

from blockcache_client.volumekey import load_key_fd, load_key_file

from .config import MountConfig


def volume_key(cfg: MountConfig) -> str | int:
    """What `Volume` takes as its key: the descriptor if there is one, else the file."""
    return cfg.key_fd if cfg.key_fd is not None else cfg.key_file or ""


def check_key(cfg: MountConfig) -> None:
    """Read and check the key `cfg` names: its descriptor (from the keeper,
    or `--key-fd`), else (the server of a keeper of an earlier version) the
    key file. BlockcacheError says what is wrong."""
    if cfg.key_fd is not None:
        load_key_fd(cfg.key_fd, f"--key-fd {cfg.key_fd}")
    else:
        load_key_file(cfg.key_file or "")


def inherited(cfg: MountConfig) -> tuple[int, ...]:
    """What a keeper started by `fsclient mount` inherits: `--key-fd N`'s N."""
    return (cfg.key_fd,) if cfg.key_fd is not None else ()
