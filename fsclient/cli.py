"""`fsclient`: mount a blockcache volume, unmount it, make volume keys.

    fsclient mount SOURCE MOUNTPOINT --volume NAME --key-file FILE [options]
    fsclient mount --config /etc/blockcache/volumes/NAME.toml
    fsclient umount MOUNTPOINT [--lazy]
    fsclient keygen FILE
    fsclient warmup (--config FILE | --mount DIR | SOURCE --volume NAME --key-file FILE)
                    [PATHS...] [-f FILELIST] [-p N] [--shard I/N | --check | --evict]

Errors print one line (`fsclient: error: ...`) and exit 1; usage errors exit 2.
Subcommands are registered on the `main` group, so other modules (warmup)
add theirs with `@main.command()`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

import click

from blockcache_client.common.logsetup import FORMATS, LEVELS, setup_logging
from blockcache_client.contract.errors import BlockcacheError
from blockcache_client.keygen import keygen_command

from .config import build_config, load_toml, parse_dir_ttl_flag

log = logging.getLogger(__name__)


def fail(message: str) -> NoReturn:
    click.echo(f"fsclient: error: {message}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(LEVELS, case_sensitive=False))
@click.option("--log-format", default="text", show_default=True, type=click.Choice(FORMATS))
@click.pass_context
def main(ctx: click.Context, log_level: str, log_format: str) -> None:
    """Mount blockcache volumes through the host's shared block cache (read-only,
    or writable: files written are staged on the node and uploaded on close)."""
    setup_logging(log_level, log_format)
    ctx.obj = {"log_level": log_level, "log_format": log_format}


@main.command()
@click.argument("source", required=False)
@click.argument("mountpoint", required=False)
@click.option("--volume", help="Volume name (the cache key namespace): [a-z0-9.-].")
@click.option("--key-file", help="Volume key file (fsclient keygen).")
@click.option("--key-fd", type=click.IntRange(0), metavar="N",
              help="An open descriptor of the volume key file, instead of --key-file: "
                   "the mount never opens the key by path.")
@click.option("--socket", help="blockcached socket [default: $BLOCKCACHE_SOCKET or "
                               "/run/blockcache/blockcached.sock].")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="Volume TOML file; flags override its values.")
@click.option("--block-size", help="Block size, e.g. 4M [default: 4M].")
@click.option("--meta-ttl", metavar="DURATION",
              help="Metadata TTL, e.g. 60 or 2m [default: 60 seconds].")
@click.option("--dir-ttl", multiple=True, metavar="PREFIX=SECONDS",
              help="Metadata TTL for a directory prefix (repeatable), e.g. code/=0.")
@click.option("--readahead-blocks", type=int, help="Blocks prefetched ahead of a "
                                                   "sequential reader [default: 2].")
@click.option("-o", "options", multiple=True, metavar="OPT[,OPT]",
              help="FUSE mount options, e.g. -o allow_other.")
@click.option("--foreground", "-f", is_flag=True, help="Stay in the foreground.")
@click.option("--log-file", type=click.Path(dir_okay=False),
              help="Where the background process logs (default: nowhere).")
@click.option("--metrics-addr", metavar="HOST:PORT",
              help="Serve Prometheus metrics of this mount there [default: off].")
@click.option("--log-level", "mount_log_level", type=click.Choice(LEVELS, case_sensitive=False),
              help="As `fsclient --log-level`, given after `mount`.")
@click.option("--log-format", "mount_log_format", type=click.Choice(FORMATS),
              help="As `fsclient --log-format`, given after `mount`.")
@click.option("--server-user", metavar="UID:GID",
              help="Run the server (not the keeper, which mounts) as UID:GID, with no "
                   "capabilities [default: as the keeper].")
@click.option("--server-group", "server_groups", multiple=True, type=int, metavar="GID",
              help="A supplementary group of the server (repeatable), e.g. the group of "
                   "blockcached's socket.")
@click.option("--max-nodes", type=int, metavar="N",
              help="Files and directories the server keeps track of at once, at most; past "
                   "that it asks the kernel to forget the least recently used "
                   "(memory: fsclient/DESIGN.md) [default: 50000].")
@click.option("--writable", is_flag=True, default=None,
              help="Accept writes: a file written is staged on this node and uploaded "
                   "as one object when closed (fsclient/DESIGN.md) [default: read-only].")
@click.option("--staging-dir", metavar="DIR",
              help="Where a writable mount stages files being written [default: "
                   "$BLOCKCACHE_STAGING_DIR or /var/tmp].")
@click.option("--staging-bytes", metavar="SIZE",
              help="The most bytes a writable mount stages at once, e.g. 64G; past it a "
                   "write gets ENOSPC [default: 16G].")
@click.option("--write-access", type=click.Choice(["owner", "all"]),
              help="Who may write a writable mount: the server's uid ('owner'), or every "
                   "uid that reaches it ('all': files 0666, directories 0777) [default: "
                   "owner].")
@click.option("--ready-fd", type=int, hidden=True)
@click.option("--serve-fd", type=int, hidden=True)
@click.option("--key-from-keeper", is_flag=True, hidden=True)  # (successor.KEY_FLAG)
@click.pass_context
def mount(ctx: click.Context, source: str | None, mountpoint: str | None, volume: str | None,
          key_file: str | None, key_fd: int | None, socket: str | None,
          config_file: str | None, block_size: str | None, meta_ttl: str | None,
          dir_ttl: tuple[str, ...], readahead_blocks: int | None, options: tuple[str, ...],
          foreground: bool,
          log_file: str | None, metrics_addr: str | None, mount_log_level: str | None,
          mount_log_format: str | None, server_user: str | None,
          server_groups: tuple[int, ...], max_nodes: int | None, writable: bool | None,
          staging_dir: str | None, staging_bytes: str | None, write_access: str | None,
          ready_fd: int | None,
          serve_fd: int | None, key_from_keeper: bool) -> None:
    """Mount SOURCE (a local path or fsspec URL) on MOUNTPOINT, read-only
    (or writable, with --writable).

    Returns once the mount answers; with --foreground, serves until unmounted
    or SIGTERM/SIGINT. A keeper process holds the mount and restarts its server
    if it dies. A dead mount left on MOUNTPOINT is recovered; on a live one, its
    server is restarted (as `fsclient restart`).
    """
    from . import mount as mounting
    from .keeper import keeping
    from .keeper.privileges import not_dumpable

    if serve_fd is not None or foreground:
        # first: a server or keeper holds the volume key, which its uid must not read
        not_dumpable()
    link = None
    if serve_fd is not None:
        from .keeper.handoff import KeeperLink
        link = KeeperLink(serve_fd)
        if key_from_keeper:  # (`mountkey`: a server never opens the key file)
            try:
                key_fd = link.key()
            except OSError as exc:
                mounting.Readiness(ready_fd).error(f"the keeper sent no volume key: {exc}")
                sys.exit(1)
    if mount_log_level or mount_log_format:
        setup_logging(mount_log_level or ctx.obj["log_level"],
                      mount_log_format or ctx.obj["log_format"])
    try:
        file_data: dict[str, Any] = load_toml(config_file) if config_file else {}
        cfg = build_config(
            file_data, volume=volume, source=source, mountpoint=mountpoint, key_file=key_file,
            socket=socket, block_size=block_size, meta_ttl=meta_ttl,
            readahead_blocks=readahead_blocks, metrics_addr=metrics_addr,
            dir_ttl=[parse_dir_ttl_flag(d) for d in dir_ttl], options=options,
            server_user=server_user, server_groups=list(server_groups) or None, key_fd=key_fd,
            max_nodes=max_nodes, writable=writable, staging_dir=staging_dir,
            staging_bytes=staging_bytes, write_access=write_access)
    except BlockcacheError as exc:
        fail(str(exc))
    if link is not None:
        code = mounting.run(cfg, mounting.Readiness(ready_fd), link)
    elif foreground:
        code = keeping.run(cfg, sys.argv[1:], ready_fd)
    else:
        argv = [a for a in sys.argv[1:]]
        code = mounting.run_background(argv, cfg, log_file)
    sys.exit(code)


@main.command()
@click.argument("mountpoint", type=click.Path(file_okay=False))
def restart(mountpoint: str) -> None:
    """Replace the server of the mount on MOUNTPOINT without unmounting: a new
    process (the fsclient installed now) takes over, no read fails."""
    from . import keeper

    try:
        answer = keeper.restart(mountpoint)
    except BlockcacheError as exc:
        fail(str(exc))
    click.echo(f"restarted {mountpoint}: server pid {answer['server']}, "
               f"{answer['restarts']} restarts")


@main.command()
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(mountpoint: str, as_json: bool) -> None:
    """The keeper's and the server's pids, the restarts, the node ids and open
    handles the server recovered from the servers before it, what bounds it
    (its RSS and memory bound, its nodes and their cap, --max-nodes; the saved
    state's size and cap), and what a restart or a killed server costs a
    reader on this kernel (FUSE minor)."""
    import json

    from . import keeper

    try:
        answer = keeper.status(mountpoint)
    except BlockcacheError as exc:
        fail(str(exc))
    answer.pop("ok", None)
    answer.update(keeper.recovered(mountpoint))
    answer["restart"] = keeper.guarantee(answer.get("fuse_minor"))
    if as_json:
        click.echo(json.dumps(answer))
    else:
        click.echo(f"{answer['mountpoint']}: keeper {answer['keeper']}, server "
                   f"{answer['server']}, {answer['restarts']} restarts, "
                   f"{answer.get('nodes_recovered', '?')} nodes and "
                   f"{answer.get('handles_recovered', '?')} handles recovered, "
                   f"{answer.get('saved_nodes', '?')} nodes saved in "
                   f"{answer.get('saved_bytes', '?')} bytes "
                   f"(at most {answer.get('saved_cap_bytes', '?')}); server RSS "
                   f"{answer.get('server_rss_bytes', '?')} bytes (bound "
                   f"{answer.get('server_rss_bound_bytes', '?')}), "
                   f"{answer.get('nodes', '?')} nodes of {answer.get('max_nodes', '?')}; "
                   f"restart: {answer['restart']}")


@main.command()
@click.argument("mountpoint")
@click.option("--lazy", "-z", is_flag=True, help="Detach now even if files are open.")
def umount(mountpoint: str, lazy: bool) -> None:
    """Unmount a volume mounted with fsclient."""
    from . import mount as mounting

    try:
        mounting.unmount(mountpoint, lazy=lazy)
    except BlockcacheError as exc:
        fail(str(exc))


main.add_command(keygen_command(fail))


def _shard_option(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """`--shard I/N` parsed; a bad value is a usage error that says why."""
    if value is None:
        return None
    from .warmup.shard import parse_shard

    try:
        return parse_shard(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@main.command(context_settings={"ignore_unknown_options": False})
@click.argument("args", nargs=-1, metavar="[SOURCE] [PATHS]...")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="Volume TOML file (as for mount).")
@click.option("--mount", "mount_path", type=click.Path(file_okay=False),
              help="A running fsclient mount point: use its volume settings.")
@click.option("--volume", help="Volume name, with SOURCE as the first argument.")
@click.option("--key-file", help="Volume key file, with SOURCE as the first argument.")
@click.option("--block-size", help="Block size; must be the mount's [default: 4M].")
@click.option("--socket", help="blockcached socket [default: the volume's, or "
                               "$BLOCKCACHE_SOCKET or /run/blockcache/blockcached.sock].")
@click.option("-f", "--file-list", type=click.File("r"), metavar="FILELIST",
              help="Paths to warm, one a line ('-' for stdin).")
@click.option("-p", "--parallel", type=click.IntRange(1, 1024), metavar="N",
              help="Blocks fetched at once [default: the CPU count, 8..64].")
@click.option("--shard", metavar="I/N", callback=_shard_option,
              help="Cooperative warmup on N hosts: warm only this host's share, shard I "
                   "(0..N-1) of N; each file belongs to exactly one shard.")
@click.option("--check", is_flag=True, help="Only print how much of each path is cached.")
@click.option("--evict", is_flag=True, help="Remove these paths' blocks from the cache.")
@click.option("--progress-interval", type=float, default=10.0, show_default=True,
              help="Seconds between progress lines when stderr is not a terminal.")
def warmup(args: tuple[str, ...], config_file: str | None, mount_path: str | None,
           volume: str | None, key_file: str | None, block_size: str | None,
           socket: str | None, file_list: Any, parallel: int | None, shard: Any, check: bool,
           evict: bool, progress_interval: float) -> None:
    """Load PATHS (files or directories, default: the whole volume) into the host cache.

    \b
    fsclient warmup --config VOLUME.toml [PATHS...] [-f FILELIST] [-p N] [--shard I/N]
    fsclient warmup --mount MOUNTPOINT [PATHS...] [--check | --evict]
    fsclient warmup SOURCE --volume NAME --key-file FILE [PATHS...]

    Already cached blocks are skipped, so an interrupted warmup resumes where
    it stopped. Exit codes: 0 all done, 1 something failed, 130 interrupted.

    \b
    On N hosts sharing a cluster tier, run the same command with
    --shard 0/N on the first host, --shard 1/N on the second, ... --shard N-1/N
    on the last: each file is fetched from the remote by one host only, and
    the others read it from the tier (a later warmup without --shard, or the
    job itself). In a Kubernetes Indexed Job: --shard $(JOB_COMPLETION_INDEX)/N.
    """
    from . import mount as mounting
    from . import warmup as warm

    if check and evict:
        raise click.UsageError("give at most one of --check and --evict")
    if shard is not None and (check or evict):
        raise click.UsageError("--shard only applies to warming: --check and --evict act on "
                               "every path given, on this host's cache")
    if sum(x is not None for x in (config_file, mount_path, volume)) != 1:
        raise click.UsageError("give exactly one of --config FILE, --mount MOUNTPOINT, or "
                               "SOURCE --volume NAME --key-file FILE")
    paths = list(args)
    try:
        if config_file:
            data = load_toml(config_file)
        elif mount_path:
            data = warm.mount_config(mount_path)
            data["mountpoint"] = mount_path
        else:
            if not paths:
                raise click.UsageError("SOURCE is missing: fsclient warmup SOURCE --volume NAME "
                                       "--key-file FILE [PATHS...]")
            data = {"source": paths.pop(0)}
        mountpoint = data.get("mountpoint")
        cfg = build_config(data, volume=volume, key_file=key_file, socket=socket,
                           block_size=block_size,
                           # warmup mounts nothing; the mount point only locates paths
                           mountpoint=None if mountpoint else "(not mounted)")
        vol = mounting.open_volume(cfg)
    except BlockcacheError as exc:
        fail(str(exc))
    try:
        items = warm.targets(paths, warm.read_file_list(file_list) if file_list else (),
                             os.path.abspath(mountpoint) if mountpoint else None)
        mode = "check" if check else "evict" if evict else "warm"
        code = warm.run(vol, mode, items, parallel or warm.default_parallel(),
                        cfg.fill_queue_bytes, sys.stdout, sys.stderr, progress_interval, shard)
    finally:
        vol.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
