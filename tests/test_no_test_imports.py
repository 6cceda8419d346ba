"""No test module imports another: shared helpers live in tests/support.

A helper imported out of a `test_*.py` module drags that module's tests,
marks and skips into the importer, and breaks when the tests move.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "bench", "devtools")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def imported_modules(source: str, importer: str) -> list[tuple[int, str]]:
    """(line, module) for every import in `source`, at any depth, relative
    imports resolved against the module `importer`; `from a import b` also
    yields `a.b`, which is how a module is imported from its package."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = importer.split(".")[:-node.level]
                base = ".".join(package + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def imports_of_test_modules(source: str, importer: str) -> list[str]:
    """The test modules (`test_*`) that `source` imports."""
    return [f"line {line}: {mod}" for line, mod in imported_modules(source, importer)
            if mod.rsplit(".", 1)[-1].startswith("test_")]



def test_no_module_imports_a_test_module():
    found = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            for hit in imports_of_test_modules(path.read_text(), module_name(path)):
                found.append(f"{path.relative_to(REPO)} {hit}")
    assert not found, ("test modules imported (move the helpers to tests/support):\n"
                       + "\n".join(found))


def test_the_check_finds_every_form_of_such_an_import():
    importer = "tests.integration.test_fill_area"
    for source in ("from .test_daemon import make_key",
                   "from tests.integration.test_daemon import make_key",
                   "from tests.integration import test_daemon",
                   "import tests.integration.test_daemon",
                   "def f():\n    from . import test_daemon\n"):
        assert imports_of_test_modules(source, importer), source
    for source in ("from tests.support.blocks import make_key",
                   "from tests.integration.conftest import BLOCK",
                   "import pytest"):
        assert not imports_of_test_modules(source, importer), source
