"""The house stays readable: no production module over 400 lines and no function over 80 lines in the serving
packages (generated protobuf stubs aside). A module that grows past it is split by concern, a function into named
steps (docs/design.md, the module map)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "cdb_engine", "cdb_scheduler", "clients", "cdb", "cdb_bench")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(
        p
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if "_pb2" not in p.name and "_native_build" not in p.parts
    )


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split by concern: {long}"


def test_no_function_is_over_80_lines() -> None:
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert not long, f"split into named steps: {long}"


def test_the_check_sees_the_packages() -> None:
    assert len(_modules()) > 150 and all((ROOT / package / "__init__.py").exists() for package in PACKAGES)
