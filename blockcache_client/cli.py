"""`blockcache-cli`: inspect and manage the local blockcached; make volume keys.

    blockcache-cli [--socket PATH] stats [--json] [--watch [SECONDS]]
    blockcache-cli evict --key K | --inode VOL INODE | --volume VOL | --all
    blockcache-cli ls [--volume VOL] [--limit N]
    blockcache-cli ping
    blockcache-cli keygen FILE

Every failure (daemon down, refused request, bad argument) is one line on
stderr and a non-zero exit code, never a traceback: 1 = the daemon refused or
failed the request, 2 = usage, 3 = the daemon is unavailable. More
subcommands attach to `main` with `@main.command()`.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import click

from .contract import protocol
from .contract.errors import BlockcacheError, DaemonError, DaemonUnavailable
from .contract.units import format_size
from .daemonclient.client import Client
from .keygen import keygen_command

EXIT_REFUSED = 1
EXIT_UNAVAILABLE = 3


def fail(message: str, code: int = EXIT_REFUSED) -> NoReturn:
    click.echo(f"blockcache-cli: {message}", err=True)
    sys.exit(code)


def fail_cleanly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn project errors into one line on stderr and an exit code."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DaemonUnavailable as exc:
            fail(str(exc), EXIT_UNAVAILABLE)
        except DaemonError as exc:
            fail(f"the daemon refused: {exc.message} [{exc.code}]")
        except BlockcacheError as exc:
            fail(str(exc))
    return wrapper


@click.group()
@click.option("--socket", "socket_path", default=None, metavar="PATH",
              help="daemon socket (default $BLOCKCACHE_SOCKET or /run/blockcache/blockcached.sock)")
@click.option("--timeout", default=5.0, show_default=True, help="seconds to wait for the daemon")
@click.pass_context
def main(ctx: click.Context, socket_path: str | None, timeout: float) -> None:
    """Inspect and manage the local block cache daemon; make volume keys."""
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
@click.option("--watch", type=click.FloatRange(min=0.1), is_flag=False, flag_value=2.0,
              default=None, metavar="[SECONDS]",
              help="refresh every SECONDS (default 2) until Ctrl-C")
@click.pass_context
@fail_cleanly
def stats(ctx: click.Context, as_json: bool, watch: float | None) -> None:
    """Cache usage, hit counts, dirs and volumes."""
    if watch is not None:
        watch_stats(ctx, as_json, watch)
        return
    with client_of(ctx) as c:
        s = stats_map(c)
    click.echo(json.dumps(s, indent=2, sort_keys=True) if as_json else render_stats(s))


def stats_map(c: Client) -> dict[str, Any]:
    """The daemon's stats map, without the reply envelope."""
    return {k: v for k, v in c.stats().items() if k not in ("id", "ok")}


def watch_stats(ctx: click.Context, as_json: bool, every: float) -> None:
    """Print the stats every `every` seconds until Ctrl-C (exit 0). On a terminal
    the screen is redrawn; otherwise blocks are printed one after another. A
    daemon that goes away is reported and waited for, not fatal."""
    tty = sys.stdout.isatty()
    c = client_of(ctx)
    try:
        while True:
            try:
                s = stats_map(c)
                body = json.dumps(s, sort_keys=True) if as_json else render_stats(s)
            except DaemonUnavailable as exc:
                body = f"blockcache-cli: {exc} (retrying)"
            if as_json:
                click.echo(body)  # one JSON map per line
            else:
                head = f"blockcached at {ctx.find_root().obj['socket']}  {time.strftime('%F %T')}" \
                       f"  (every {every:g}s, Ctrl-C to stop)"
                click.echo(("\x1b[H\x1b[2J" if tty else "") + head + "\n\n" + body
                           + ("" if tty else "\n"))
            sys.stdout.flush()
            time.sleep(every)
    except KeyboardInterrupt:
        pass
    finally:
        c.close()


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
        f"readers      hits {s.get('touches', 0)}, puts {s.get('puts', 0)}, hit ratio "
        f"{_ratio(s.get('touches', 0), s.get('puts', 0))} "
        f"(by bytes {_ratio(s.get('touch_bytes', 0), s.get('put_bytes', 0))})",
        f"puts         {s.get('puts', 0)} ({format_size(s.get('put_bytes', 0))}), "
        f"written {s.get('writes', 0)}, dropped {s.get('drops', 0)}",
        f"evictions    {s.get('evictions', 0)}{_reasons(s.get('evictions_by_reason'))}",
        _admission_line(s.get("policy") or {}),
        f"rebuild      {rebuild.get('state', '?')} (scanned {rebuild.get('scanned', 0)}, "
        f"removed {rebuild.get('removed', 0)})",
        f"connections  {s.get('connections', 0)}",
    ]
    slots = s.get("volume_slots")
    if slots:
        per_uid = slots.get("per_uid") or "no limit"
        lines.append(f"volumes      {slots.get('held', 0)} of {slots.get('limit', 0)} slots "
                     f"(per uid {per_uid}; {slots.get('unowned', 0)} owned by no uid)")
    leases = s.get("leases")
    if leases:
        lines.append(_leases_line(leases))
    refused = s.get("refused") or {}
    if refused:
        lines.append("refused      " + ", ".join(f"{k} {v}" for k, v in sorted(refused.items())))
    errors = s.get("errors") or {}
    if errors:
        lines.append("errors       " + ", ".join(f"{k} {v}" for k, v in sorted(errors.items())))
    lines += _dir_lines(s.get("dirs", []))
    vols = s.get("volumes") or {}
    if vols:
        lines += ["", f"{'VOLUME':<28} {'ENTRIES':>9} {'USED':>11} {'QUOTA':>11} {'HITS':>9} "
                      f"{'PUTS':>9} {'HIT RATIO':>9} {'BY BYTES':>9}"]
        for name, v in sorted(vols.items()):
            hits, puts = v.get("touches", 0), v.get("puts", 0)
            quota = v.get("quota_bytes", 0)
            lines.append(f"{name:<28} {v['entries']:>9} {format_size(v['used_bytes']):>11} "
                         f"{format_size(quota) if quota else '-':>11} "
                         f"{hits:>9} {puts:>9} {_ratio(hits, puts):>9} "
                         f"{_ratio(v.get('touch_bytes', 0), v.get('put_bytes', 0)):>9}")
        lines += ["hit ratio = hits / (hits + puts): blocks readers reported reading from the",
                  "cache over those plus blocks they filled after a miss (reads served from a",
                  "reader's own memory cache are not reported)"]
    lines += _cluster_lines(s.get("cluster") or {})
    return "\n".join(lines)


def _cluster_lines(c: dict[str, Any]) -> list[str]:
    """The cluster tier: its servers and what readers reported, per volume."""
    if not c.get("enabled"):
        return []
    lines = ["", f"cluster      memcached {', '.join(c.get('memcached', []))}",
             f"{'CLUSTER VOLUME':<28} {'HITS':>9} {'MISSES':>9} {'RECEIVED':>11} "
             f"{'ERRORS':>7} {'BAD':>5} {'FILLS':>9} {'DROPPED':>8}"]
    for name, v in sorted((c.get("volumes") or {}).items()):
        lines.append(f"{name:<28} {v['hits']:>9} {v['misses']:>9} "
                     f"{format_size(v['bytes']):>11} {v['errors']:>7} {v['bad']:>5} "
                     f"{v['fills_sent']:>9} {v['fills_dropped']:>8}")
    return lines


def _leases_line(le: dict[str, Any]) -> str:
    """Fetch leases: how many, who waited, what the waits saved, how leases ended."""
    if not le.get("timeout"):
        return "leases       off (lease_timeout 0)"
    ended = {k: le.get(k, 0) for k in ("filled", "expired", "lost", "declined", "released")}
    return (f"leases       taken {le.get('taken', 0)}, waits {le.get('waits', 0)}, fetches saved "
            f"{le.get('saved', 0)}, expired {ended['expired']}, holders lost {ended['lost']}"
            f"{_reasons({k: v for k, v in ended.items() if v and k in ('declined', 'released')})}"
            f"; held {le.get('held', 0)}, waiting {le.get('waiting', 0)}")


def _reasons(counts: dict[str, int] | None) -> str:
    """ " (a 3, b 1)" from {reason: count}, or "" when there are none."""
    if not counts:
        return ""
    return " (" + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ")"


def _admission_line(p: dict[str, Any]) -> str:
    """What the capacity policy admitted and refused, and why."""
    admitted, refused = p.get("admitted") or {}, p.get("rejected") or {}
    stale = f", demoted {p['demoted']} no longer hit" if p.get("demoted") else ""
    return (f"admission    {p.get('name', '?')}: admitted {sum(admitted.values())}"
            f"{_reasons(admitted)}, refused {sum(refused.values())}{_reasons(refused)}{stale}")


def _ratio(hits: int, misses: int) -> str:
    return f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"


def _dir_lines(dirs: list[dict[str, Any]]) -> list[str]:
    """Per dir: health, and use against the effective limit and its watermarks."""
    lines = ["", f"{'DIR':<36} {'HEALTH':<10} {'ENTRIES':>9} {'USED':>11} {'LIMIT':>11} "
                 f"{'USE':>6}  WATERMARKS"]
    for d in dirs:
        limit = d.get("limit_bytes", d.get("capacity_bytes", 0))
        used = d.get("used_bytes", 0)
        health = "ok" if d.get("healthy") else "DOWN"
        if d.get("rebuilding"):
            health = "scanning"
        use = f"{100 * used / limit:.1f}%" if limit else "-"
        lines.append(f"{d['path']:<36} {health:<10} {d.get('entries', 0):>9} "
                     f"{format_size(used):>11} {format_size(limit):>11} {use:>6}  "
                     f"kept under {100 * d.get('high_watermark', 0):.0f}%, trimmed to "
                     f"{100 * d.get('low_watermark', 0):.0f}%")
        if not d.get("healthy") and d.get("unhealthy_reason"):
            lines.append(f"    taken out: {d['unhealthy_reason']}")
        if limit < d.get("capacity_bytes", 0):
            lines.append(f"    limit below the configured {format_size(d['capacity_bytes'])}: "
                         f"the disk's free-space floor binds")
    return lines


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
@click.option("--limit", default=1000, show_default=True, type=click.IntRange(0),
              help="most keys shown (fetched a page at a time); 0 = all")
@click.pass_context
@fail_cleanly
def ls(ctx: click.Context, volume: str | None, limit: int) -> None:
    """List cached block keys, sorted."""
    with client_of(ctx) as c:
        keys = c.list_all(volume, (limit + 1) if limit else None)
    for key in keys[:limit or None]:
        click.echo(key)
    if limit and len(keys) > limit:
        click.echo(f"(more than {limit}; raise --limit to see more, 0 for all)", err=True)


# Needs no daemon: a key for fsspec and Volume readers on hosts without fsclient.
main.add_command(keygen_command(fail))


if __name__ == "__main__":
    main()
