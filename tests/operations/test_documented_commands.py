"""Every command line the README and docs/ show exists and parses as written.

The command lines come from the docs themselves (tests/support/doc_commands),
so a documented subcommand or flag that does not exist fails here. Each is
parsed by the program's own parser (click, or argparse for bench) with its actions
stubbed out, each documented subcommand answers --help from its installed
script, and the examples that need only a daemon or nothing run for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from blockcache_client.contract.errors import BlockcacheError
from blockcache_client.volumekey import load_key_file
from tests.support.doc_commands import REPO, SCRIPTS, DocCommand, documented_commands


def first_of_each(commands: list[DocCommand]) -> list[DocCommand]:
    """Each command line once, named by where the docs first show it."""
    seen: dict[tuple[str, ...], DocCommand] = {}
    for c in commands:
        seen.setdefault(c.argv, c)
    return list(seen.values())


COMMANDS = first_of_each(documented_commands())
VENV_BIN = Path(sys.executable).parent


def click_group(program: str) -> click.Group:
    if program == "fsclient":
        from fsclient.cli import main
    else:
        from blockcache_client.cli import main
    return main


def commands_of(group: click.Group) -> list[click.Command]:
    out = [group]
    for cmd in group.commands.values():
        out += commands_of(cmd) if isinstance(cmd, click.Group) else [cmd]
    return out


def parse_click(cmd: DocCommand, monkeypatch) -> list[str]:
    """Run the click program on the documented args with every callback
    stubbed; returns the command path it resolved, e.g. [fsclient, mount]."""
    group = click_group(cmd.program)
    invoked: list[str] = [cmd.program]
    for c in commands_of(group):
        if c is not group:
            monkeypatch.setattr(c, "callback",
                                lambda *a, _name=c.name, **kw: invoked.append(_name))
        else:
            monkeypatch.setattr(c, "callback", lambda *a, **kw: None)
    # Files the examples name (a file list) are the reader's, not ours.
    monkeypatch.setattr(click.File, "convert", lambda self, value, param, ctx: value)
    try:
        group.main(cmd.args, prog_name=cmd.program, standalone_mode=False)
    except click.ClickException as exc:
        pytest.fail(f"{cmd}: {exc.format_message()}")
    return invoked


def parse_blockcached(cmd: DocCommand) -> None:
    """Flags and their values (sizes, watermarks, addresses), as the daemon
    would take them; a --config file named by the docs is not read."""
    from blockcached.cli import config_from_args, main
    try:
        if "--config" in cmd.args:
            main.make_context("blockcached", list(cmd.args))
        else:
            config_from_args(cmd.args)
    except (click.ClickException, BlockcacheError) as exc:
        pytest.fail(f"{cmd}: {exc}")


def parse_argparse(cmd: DocCommand, capsys) -> None:
    from bench.__main__ import parse_args
    try:
        parse_args(cmd.args)
    except SystemExit as exc:
        pytest.fail(f"{cmd}: exit {exc.code}: {capsys.readouterr().err.strip()}")


def clean_make_env() -> dict[str, str]:
    """Under `make test` the parent make's flags arrive in the environment."""
    return {k: v for k, v in os.environ.items()
            if k not in ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL")}


def test_the_docs_show_commands_of_every_program():
    programs = {c.program for c in COMMANDS}
    assert {*SCRIPTS, "make", "python -m bench"} <= programs, programs
    assert any(c.argv == ("blockcache-cli", "keygen", "FILE") for c in COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS, ids=str)
def test_documented_command_parses(cmd: DocCommand, monkeypatch, capsys):
    if cmd.program in ("fsclient", "blockcache-cli"):
        parse_click(cmd, monkeypatch)
    elif cmd.program == "blockcached":
        parse_blockcached(cmd)
    elif cmd.program == "python -m bench":
        parse_argparse(cmd, capsys)
    elif cmd.program == "make":
        r = subprocess.run(["make", "-n", "-C", str(REPO), *cmd.args], capture_output=True,
                           text=True, timeout=60, env=clean_make_env(),
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"{cmd}: {r.stderr}"
    elif cmd.program.startswith("python -m "):
        # Modules whose parser lives inside main(): --help shows it exists.
        r = subprocess.run([sys.executable, *cmd.argv[1:], "--help"], capture_output=True,
                           text=True, timeout=60, cwd=REPO)
        assert r.returncode == 0 and "usage:" in r.stdout, f"{cmd}: {r.stderr}"
    else:
        pytest.fail(f"{cmd}: no check for {cmd.program}")


def documented_subcommands() -> list[tuple[str, ...]]:
    """(script, subcommand) pairs the docs use, and each script alone."""
    seen: dict[tuple[str, ...], None] = {}
    for c in COMMANDS:
        if c.program in SCRIPTS:
            seen[(c.program,)] = None
            if c.program != "blockcached":
                sub = next((a for a in c.args if not a.startswith("-")), None)
                group = click_group(c.program)
                if sub in group.commands:
                    seen[(c.program, sub)] = None
    return list(seen)


@pytest.mark.parametrize("words", documented_subcommands(), ids=" ".join)
def test_installed_script_answers_help(words):
    script = VENV_BIN / words[0]
    assert script.is_file(), f"{words[0]} is not installed beside {sys.executable}"
    r = subprocess.run([str(script), *words[1:], "--help"], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert f"{' '.join(words)} [" in r.stdout.replace("Usage: ", "").replace("usage: ", "")


def test_documented_keygen_examples_make_keys(tmp_path):
    keygens = [c for c in COMMANDS if c.program in SCRIPTS and c.args[:1] == ["keygen"]]
    assert {c.program for c in keygens} == {"fsclient", "blockcache-cli"}
    for i, c in enumerate(keygens):
        path = tmp_path / f"{i}-{Path(c.args[1]).name}"     # the docs' path, moved here
        r = subprocess.run([str(VENV_BIN / c.program), "keygen", str(path)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{c}: {r.stderr}"
        assert len(load_key_file(str(path))) == 32


def test_documented_cli_examples_run_against_a_daemon(daemon):
    # Everything blockcache-cli shows that talks to a daemon, except the
    # endless --watch; the examples' volume need not hold blocks (`ls` of an
    # empty cache prints nothing).
    examples = [c for c in COMMANDS if c.program == "blockcache-cli"
                and c.args[:1] != ["keygen"] and "--watch" not in c.args]
    assert {c.args[0] for c in examples} >= {"ping", "stats", "evict", "ls"}
    env = {**os.environ, "BLOCKCACHE_SOCKET": daemon.socket_path}
    for c in examples:
        r = subprocess.run([str(VENV_BIN / c.program), *c.args], capture_output=True,
                           text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
        assert r.returncode == 0 and not r.stderr, f"{c}: {r.stderr}"
