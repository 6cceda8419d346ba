"""The daemon keeps one concern per module: none grows past 450 lines
(past that, a module has usually started owning a second thing)."""

from __future__ import annotations

from pathlib import Path

import blockcached

MAX_LINES = 450


def test_no_daemon_module_is_over_450_lines():
    root = Path(blockcached.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in root.glob("*.py")}
    assert len(sizes) > 20  # the package, not an empty glob
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}
