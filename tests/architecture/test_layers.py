"""The architecture of docs/architecture.md, checked: import-linter's contracts (pyproject.toml),
no import cycles, and modules small enough to read."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

# dev tools ([dev] extra), absent from a bare GPU image that runs only the gpu tier
grimp = pytest.importorskip("grimp")
lint_imports = pytest.importorskip("importlinter.cli").lint_imports

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "aegis_cli"
MAX_LINES = 450
MAX_CLI_LINES = 300


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), lazy and TYPE_CHECKING
    imports included: each is a cycle somewhere."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for m in sorted(graph.modules):
            if m not in index:
                visit(m)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_the_package_has_no_import_cycles():
    assert import_cycles(grimp.build_graph("aegis_cli")) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyc import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyc import c\n")
    (pkg / "c.py").write_text("from cyc import a\n")
    (pkg / "d.py").write_text("from cyc import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles(grimp.build_graph("cyc", cache_dir=None)) == [["cyc.a", "cyc.b", "cyc.c"]]


def test_import_linter_contracts_hold(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))  # lint_imports prepends the working directory
    # lint_imports configures logging and disables the loggers that exist (aegis.sensors' among
    # them): restored afterwards, or later tests reading those logs see nothing
    for logger in list(logging.root.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger):
            monkeypatch.setattr(logger, "disabled", logger.disabled)
    assert lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True, no_logo=True) == 0  # the report is in stdout


def test_no_module_is_too_long_to_read():
    long = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
    assert len((PACKAGE / "cli.py").read_text().splitlines()) < MAX_CLI_LINES
