"""`blockcached`: the per-host cache daemon's command line.

Flags mirror the TOML keys (`--fill-queue-bytes` is `fill_queue_bytes`) and
win over `--config FILE.toml`; both go through the same converters in
config.py, so a flag and a key accept the same values and fail the same way.
Errors print one line (`blockcached: ...`) and exit 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from blockcache_client.contract.errors import BlockcacheError

from . import config as configmod
from .config import Config

# (flag, metavar, help); each flag's value is converted like its TOML key
_VALUE_FLAGS = (
    ("--socket", "PATH", "Unix socket [default: $BLOCKCACHE_SOCKET or "
                         "/run/blockcache/blockcached.sock]."),
    ("--socket-mode", "0660", "Mode of the socket: who may connect [default: 0660]."),
    ("--socket-group", "NAME|GID", "Group of the socket [default: the daemon's]."),
    ("--unlisted-volumes", "open|admin",
     "Volumes with no access table: open to every peer, or admin only [default: open]."),
    ("--max-connections-per-uid", "N", "Connections one peer uid may hold [default: 768]."),
    ("--max-reply-bytes-per-uid", "SIZE", "Unread reply bytes per peer uid [default: 64M]."),
    ("--fill-queue-share", "0.5", "Share of the fill queue one peer uid may hold [default: 0.5]."),
    ("--max-volumes", "N", "Distinct volumes indexed and counted at once [default: 4096]."),
    ("--max-volumes-per-uid", "N",
     "Of --max-volumes, how many one non-admin peer uid may bring in; a volume's slot is "
     "freed when its last block leaves; 0 = no per-uid limit [default: 800]."),
    ("--lease-timeout", "DURATION",
     "Longest a reader's fetch lease on a cold block lasts: other readers of the block wait "
     "at most this for its fill, then fetch it themselves; 0 = no leases [default: 2s]."),
    ("--max-leases-per-uid", "N",
     "Fetch leases one non-admin peer uid may hold at once; 0 = no per-uid limit "
     "[default: 2816]."),
    ("--high-watermark", "0.98", "A full dir is kept at this share of its limit [default: 0.98]."),
    ("--low-watermark", "0.95",
     "A dir found above the high watermark is trimmed to this [default: 0.95]."),
    ("--min-free-bytes", "SIZE", "Free space left on each cache dir's file system [default: 1G]."),
    ("--min-free-inodes", "N", "Free inodes left on each cache dir's file system "
                               "[default: 10000]."),
    ("--max-entries", "N", "Most blocks indexed [default: no limit]."),
    ("--fill-queue-bytes", "SIZE", "Blocks waiting to be written, in bytes [default: 256M]."),
    ("--io-timeout", "DURATION", "A cache dir slower than this is taken out [default: 5s]."),
    ("--frame-timeout", "DURATION", "A connection whose request has not arrived whole this long "
                                    "after it connected or began sending is closed "
                                    "[default: 30s]."),
    ("--log-level", "LEVEL", "debug, info, warning or error [default: info]."),
    ("--log-format", "text|json", "Log line format [default: text]."),
    ("--metrics-addr", "HOST:PORT", "Serve Prometheus metrics there [default: off]."),
    ("--memcached", "HOST:PORT[,...]",
     "The cluster tier: memcached servers readers share sealed blocks through, handed to "
     "them in hello; a DNS name is re-resolved to all its addresses (overrides [cluster] "
     "memcached; '' turns the tier off) [default: none]."),
    ("--admission-policy", "tinylfu|lru",
     "Which blocks a full cache keeps: tinylfu (a block gets in only if asked for more often "
     "than the ones it would evict) or lru [default: tinylfu]."),
)


def _with_value_flags(command: Any) -> Any:
    for flag, metavar, text in reversed(_VALUE_FLAGS):
        command = click.option(flag, metavar=metavar, help=text)(command)
    return command


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_file", metavar="FILE.toml",
              help="Daemon TOML file; flags override its values.")
@click.option("--cache-dir", "cache_dirs", multiple=True, metavar="DIR[:SIZE]",
              help="A cache dir and its size limit (repeatable) [default size: "
                   f"{configmod.DEFAULT_DIR_SIZE}].")
@click.option("--admin-gid", "admin_gids", multiple=True, metavar="GID",
              help="Admin groups (repeatable).")
@click.option("--admin-uid", "admin_uids", multiple=True, metavar="UID",
              help="Admin users (repeatable) [default: root only]; --admin-uid '' makes "
                   "no uid admin.")
@click.option("--volume-access", multiple=True, metavar="VOL=uid:U,gid:G",
              help="Who besides admins may put, list and evict VOL's blocks (repeatable).")
@_with_value_flags
def main(config_file: str | None, **flags: Any) -> None:
    """Per-host block cache daemon."""
    try:
        cfg = load_config(config_file, flags)
    except BlockcacheError as exc:
        click.echo(f"blockcached: {exc}", err=True)
        sys.exit(2)
    from .lifecycle import run  # the serving side loads only when it runs
    sys.exit(run(cfg))


def load_config(config_file: str | None, flags: dict[str, Any]) -> Config:
    """The daemon's Config from its TOML file and flags (flags win)."""
    file_values = configmod.load_file(config_file) if config_file else {}
    flags = dict(flags)
    flags["cache_dirs"] = [configmod.parse_cache_dir_flag(d) for d in flags.get("cache_dirs", ())]
    for many in ("admin_gids", "admin_uids"):
        flags[many] = list(flags[many]) if flags.get(many) else None
    return configmod.build(file_values, flags)


def config_from_args(argv: Sequence[str]) -> Config:
    """Parse a `blockcached` command line into its Config without serving.
    Raises click.UsageError for an unknown flag, ConfigError for a bad value."""
    ctx = main.make_context("blockcached", list(argv))
    params = dict(ctx.params)
    return load_config(params.pop("config_file"), params)
