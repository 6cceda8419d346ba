"""The project's commands that the README and docs/ show, as argv lists.

Taken from shell code blocks (fenced, also indented inside lists; backslash
continuations joined, comments and leading VAR=value assignments dropped)
and from inline code spans, wherever a line or span starts with one of our
programs: blockcached, fsclient, blockcache-cli, `python -m` one of our
packages, or `make`. Other tools (systemctl, kubectl, getfattr, ...) are not
ours to check.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ("blockcached", "fsclient", "blockcache-cli")
PACKAGES = ("bench", "blockcached", "fsclient", "blockcache_client")
SHELL_LANGS = ("", "sh", "bash", "shell", "console")
FENCE = re.compile(r"^([ \t]*)```([\w-]*)[^\n]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"`([^`]+)`")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class DocCommand:
    where: str                 # "docs/deploy.md:71"
    argv: tuple[str, ...]      # the command, without VAR=value assignments

    @property
    def program(self) -> str:
        """`fsclient`, `make`, `python -m bench.fuse`, ..."""
        return " ".join(self.argv[:3]) if self.argv[0] == "python" else self.argv[0]

    @property
    def args(self) -> list[str]:
        return list(self.argv[3:] if self.argv[0] == "python" else self.argv[1:])

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def documented_commands() -> list[DocCommand]:
    out: list[DocCommand] = []
    for path in doc_files():
        text = path.read_text()
        name = str(path.relative_to(REPO))
        for m in FENCE.finditer(text):
            if m.group(2) not in SHELL_LANGS:
                continue
            first = text.count("\n", 0, m.start(3)) + 1
            for offset, line in shell_lines(textwrap.dedent(m.group(3))):
                out += ours(f"{name}:{first + offset}", line)
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in SPAN.finditer(prose):
            found = ours(f"{name}:{prose.count(chr(10), 0, m.start()) + 1}",
                         " ".join(m.group(1).split()))
            # A bare `fsclient` in prose names the program; it is no command line.
            out += [c for c in found if c.argv[0] not in SCRIPTS or len(c.argv) > 1]
    return out


def shell_lines(body: str) -> list[tuple[int, str]]:
    """(line offset, line) with backslash continuations joined."""
    lines, start, pending = [], 0, ""
    for i, raw in enumerate(body.splitlines()):
        if not pending:
            start = i
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + raw))
        pending = ""
    return lines


def ours(where: str, line: str) -> list[DocCommand]:
    """The line as a DocCommand if it runs one of our programs."""
    words = line.split()
    while words and ASSIGNMENT.match(words[0]):
        words.pop(0)
    if not words:
        return []
    python_m = (words[0] == "python" and len(words) > 2 and words[1] == "-m"
                and words[2].split(".")[0] in PACKAGES)
    if not (words[0] in SCRIPTS or words[0] == "make" or python_m):
        return []
    argv = shlex.split(" ".join(words), comments=True)
    return [DocCommand(where, tuple(argv))]
