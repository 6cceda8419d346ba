"""The `keygen` subcommand that `fsclient` and `blockcache-cli` share.

One command, so both tools make the same key file, say the same thing, and
an operator on a host without the FUSE extra (fsspec or `Volume` readers
only) has it in `blockcache-cli`. Each tool reports a failure its own way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import click

from .contract.errors import BlockcacheError
from .volumekey import generate_key_file


def keygen_command(fail: Callable[[str], NoReturn]) -> click.Command:
    """A `keygen FILE` command; `fail(message)` reports an error and exits."""

    @click.command("keygen")
    @click.argument("file", type=click.Path(dir_okay=False))
    def keygen(file: str) -> None:
        """Write a new random volume key to FILE (mode 0400; never overwrites)."""
        try:
            generate_key_file(file)
        except BlockcacheError as exc:
            fail(str(exc))
        click.echo(f"wrote a new volume key to {file}")

    return keygen
