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
