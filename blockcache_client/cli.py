"""`blockcache-cli`: inspect and manage the local blockcached.

    blockcache-cli [--socket PATH] stats [--json]
    blockcache-cli evict --key K | --inode VOL INODE | --volume VOL | --all
    blockcache-cli ls [--volume VOL] [--limit N]
    blockcache-cli ping

Every failure (daemon down, refused request, bad argument) is one line on
stderr and a non-zero exit code, never a traceback: 1 = the daemon refused or
failed the request, 2 = usage, 3 = the daemon is unavailable. More
subcommands attach to `main` with `@main.command()`.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable

import click

from . import protocol
from .client import Client
from .errors import BlockcacheError, DaemonError, DaemonUnavailable
from .units import format_size

EXIT_REFUSED = 1
EXIT_UNAVAILABLE = 3


def fail_cleanly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn project errors into one line on stderr and an exit code."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DaemonUnavailable as exc:
            click.echo(f"blockcache-cli: {exc}", err=True)
            sys.exit(EXIT_UNAVAILABLE)
        except DaemonError as exc:
            click.echo(f"blockcache-cli: the daemon refused: {exc.message} [{exc.code}]", err=True)
            sys.exit(EXIT_REFUSED)
        except BlockcacheError as exc:
            click.echo(f"blockcache-cli: {exc}", err=True)
            sys.exit(EXIT_REFUSED)
    return wrapper


@click.group()
@click.option("--socket", "socket_path", default=None, metavar="PATH",
              help="daemon socket (default $BLOCKCACHE_SOCKET or /run/blockcache/blockcached.sock)")
@click.option("--timeout", default=5.0, show_default=True, help="seconds to wait for the daemon")
@click.pass_context
def main(ctx: click.Context, socket_path: str | None, timeout: float) -> None:
    """Inspect and manage the local block cache daemon."""
    ctx.obj = {"socket": socket_path or protocol.default_socket(), "timeout": timeout}


def client_of(ctx: click.Context) -> Client:
    """A blocking client on the socket chosen by the group's options."""
    obj = ctx.find_root().obj
    return Client(obj["socket"], timeout=obj["timeout"])


@main.command()
@click.pass_context
@fail_cleanly
def ping(ctx: click.Context) -> None:
    """Check that the daemon answers."""
    with client_of(ctx) as c:
        reply = c.ping()
    click.echo(f"ok: blockcached at {ctx.find_root().obj['socket']} "
               f"(layout epoch {reply.get('layout_epoch')})")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print exactly the daemon's stats map")
@click.pass_context
@fail_cleanly
def stats(ctx: click.Context, as_json: bool) -> None:
    """Cache usage, hit counts, dirs and volumes."""
    with client_of(ctx) as c:
        reply = c.stats()
    s = {k: v for k, v in reply.items() if k not in ("id", "ok")}
    if as_json:
        click.echo(json.dumps(s, indent=2, sort_keys=True))
        return
    click.echo(render_stats(s))


def render_stats(s: dict[str, Any]) -> str:
    """The stats map as a table for people."""
    lookups = s.get("hits", 0) + s.get("misses", 0)
    ratio = f"{100 * s.get('hits', 0) / lookups:.1f}%" if lookups else "-"
    rebuild = s.get("rebuild", {})
    lines = [
        f"entries      {s.get('entries', 0)}",
        f"used         {format_size(s.get('used_bytes', 0))} of "
        f"{format_size(s.get('capacity_bytes', 0))}",
        f"lookups      {lookups} (hits {s.get('hits', 0)}, misses {s.get('misses', 0)}, "
        f"hit ratio {ratio})",
        f"puts         {s.get('puts', 0)} ({format_size(s.get('put_bytes', 0))}), "
        f"written {s.get('writes', 0)}, dropped {s.get('drops', 0)}",
        f"evictions    {s.get('evictions', 0)}",
        f"rebuild      {rebuild.get('state', '?')} (scanned {rebuild.get('scanned', 0)}, "
        f"removed {rebuild.get('removed', 0)})",
        f"connections  {s.get('connections', 0)}",
    ]
    errors = s.get("errors") or {}
    if errors:
        lines.append("errors       " + ", ".join(f"{k} {v}" for k, v in sorted(errors.items())))
    lines += ["", f"{'DIR':<40} {'HEALTHY':<8} {'ENTRIES':>9} {'USED':>11} {'CAPACITY':>11}"]
    for d in s.get("dirs", []):
        lines.append(f"{d['path']:<40} {'yes' if d.get('healthy') else 'NO':<8} "
                     f"{d.get('entries', 0):>9} {format_size(d.get('used_bytes', 0)):>11} "
                     f"{format_size(d.get('capacity_bytes', 0)):>11}")
    vols = s.get("volumes") or {}
    if vols:
        lines += ["", f"{'VOLUME':<40} {'ENTRIES':>9} {'USED':>11}"]
        for name, v in sorted(vols.items()):
            lines.append(f"{name:<40} {v['entries']:>9} {format_size(v['used_bytes']):>11}")
    return "\n".join(lines)


@main.command()
@click.option("--key", metavar="KEY", help="one block key")
@click.option("--inode", nargs=2, type=(str, int), metavar="VOL INODE",
              help="every block of one file")
@click.option("--volume", metavar="VOL", help="every block of a volume (admin)")
@click.option("--all", "everything", is_flag=True, help="every block (admin)")
@click.pass_context
@fail_cleanly
def evict(ctx: click.Context, key: str | None, inode: tuple[str, int] | None,
          volume: str | None, everything: bool) -> None:
    """Remove blocks from the cache."""
    chosen = sum(x is not None and x is not False for x in (key, inode, volume)) + everything
    if chosen != 1:
        raise click.UsageError("give exactly one of --key, --inode VOL INODE, --volume, --all")
    with client_of(ctx) as c:
        if key is not None:
            n = c.evict(key)
        elif inode is not None:
            n = c.evict(inode=inode)
        elif volume is not None:
            n = c.evict(volume=volume)
        else:
            n = c.evict(all_=True)
    click.echo(f"evicted {n} block{'s' if n != 1 else ''}")


@main.command("ls")
@click.option("--volume", metavar="VOL", help="only this volume's blocks")
@click.option("--limit", default=1000, show_default=True, type=click.IntRange(0, 100_000))
@click.pass_context
@fail_cleanly
def ls(ctx: click.Context, volume: str | None, limit: int) -> None:
    """List cached block keys, sorted."""
    with client_of(ctx) as c:
        reply = c.list(volume, limit)
    for key in reply["keys"]:
        click.echo(key)
    if reply.get("truncated"):
        click.echo(f"(more than {limit}; raise --limit to see more)", err=True)


if __name__ == "__main__":
    main()
