"""Guards on the shape of the shipped code (issue 29): no import cycles among
the shipped modules, counting imports under `if TYPE_CHECKING:` (a Protocol
serves where only a type is needed), and no shipped module over MAX_LINES."""

from __future__ import annotations

import pathlib

import grimp

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = ("blockcache_client", "blockcached", "fsclient")
MAX_LINES = 450
# Known exceptions, each being fixed on its own branch of issue 29 (the lead
# removes them at merge; `test_known_exceptions_still_fail` says when): none.
KNOWN_EXCEPTIONS: frozenset[str] = frozenset()


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The graph's strongly connected components of more than one module
    (Tarjan's algorithm): each holds at least one import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def shipped_graph() -> grimp.ImportGraph:
    # TYPE_CHECKING imports count: a cycle through one still ties the modules together
    return grimp.build_graph(*SHIPPED, exclude_type_checking_imports=False)


def module_lines() -> dict[str, int]:
    lines = {}
    for package in SHIPPED:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            lines[name.removesuffix(".__init__")] = len(path.read_bytes().splitlines())
    return lines


def test_the_cycle_finder_counts_type_checking_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "codebase_guard_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from . import b\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("codebase_guard_probe", exclude_type_checking_imports=False)
    assert import_cycles(graph) == [["codebase_guard_probe.a", "codebase_guard_probe.b"]]


def test_shipped_modules_import_no_cycle():
    cycles = [c for c in import_cycles(shipped_graph()) if not set(c) <= KNOWN_EXCEPTIONS]
    assert not cycles, ("import cycles (use a typing.Protocol where only a type is "
                        f"needed, or move the shared part down): {cycles}")


def test_no_shipped_module_is_over_the_line_limit():
    over = {m: n for m, n in module_lines().items()
            if n > MAX_LINES and m not in KNOWN_EXCEPTIONS}
    assert not over, f"modules over {MAX_LINES} lines (split them by concern): {over}"


def test_known_exceptions_still_fail():
    """An exception that no longer fails is stale: remove it from KNOWN_EXCEPTIONS."""
    failing = {m for c in import_cycles(shipped_graph()) for m in c}
    failing |= {m for m, n in module_lines().items() if n > MAX_LINES}
    stale = KNOWN_EXCEPTIONS - failing
    assert not stale, f"no longer failing, remove from KNOWN_EXCEPTIONS: {sorted(stale)}"
