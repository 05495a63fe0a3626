"""Layering rules, checked on the source: telemetry/ never imports torch or engine;
dashboard/ never imports engine (it talks to the engine only through the store and the levers file)."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "telemetry": ("torch", "engine"),
    "dashboard": ("engine",),
}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """Every absolute module an AST imports (``import a.b``, ``from a.b import c``, ``__import__('a')``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
              in ("__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(package: str) -> list[str]:
    banned = FORBIDDEN[package]
    problems = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for lineno, module in imported_modules(path.read_text(encoding="utf-8")):
            top = module.split(".")[0]
            if top in banned:
                problems.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    return problems


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_layering(package):
    if not (ROOT / package).is_dir():
        pytest.skip(f"{package}/ does not exist yet")
    assert violations(package) == []


def test_scanner_catches_every_import_form():
    source = "import torch.nn\nfrom engine.scheduler import loop\nimportlib.import_module('engine.x')\n" \
             "x = __import__('torch')\nfrom . import sibling\nimport json\n"
    assert sorted(m for _, m in imported_modules(source)) == ["engine.scheduler", "engine.x", "json", "torch", "torch.nn"]


PACKAGES = ("engine", "telemetry", "dashboard")


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def project_import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere (inside functions too), except under
    ``if TYPE_CHECKING:``; ``from pkg import name`` counts as importing ``pkg.name`` when that is a module."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        stack = [ast.parse(path.read_text(encoding="utf-8"))]
        while stack:
            node = stack.pop()
            if _is_type_checking_block(node):
                continue
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
            stack.extend(ast.iter_child_nodes(node))
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles():
    assert import_cycles(project_import_graph()) == []


def test_the_cycle_finder_finds_a_lazy_import_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
