"""The import graph of the project: no cycles between modules, no arrow from a lower layer into a higher one.

Every ``import`` counts, also one inside a function (a lazy import is still a dependency); only typing-only
imports under ``if TYPE_CHECKING:`` are left out (they never run). Layers, lowest first:

    cdb_scheduler (stdlib only) < cdb_model (torch) < cdb_engine < services < cdb_bench < cdb (the CLI)
    cdb_api (generated stubs) and clients (cdb_api + grpc only) sit beside them; cdb_train uses the model only.

Inside ``services`` the rooms are ordered too: net, settings, healthcheck, version < telemetry < transport < frontlink
< api < http < frontend < launcher. Nothing outside ``tests`` imports ``tests``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "cdb_scheduler",
    "cdb_model",
    "cdb_engine",
    "cdb_api",
    "services",
    "clients",
    "cdb_bench",
    "cdb_train",
    "cdb",
)

# Which project packages each package may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "cdb_scheduler": set(),
    "cdb_model": {"cdb_scheduler"},
    "cdb_engine": {"cdb_scheduler", "cdb_model"},
    "cdb_api": set(),
    "clients": {"cdb_api"},
    "services": {"cdb_scheduler", "cdb_model", "cdb_engine", "cdb_api"},
    "cdb_train": {"cdb_scheduler", "cdb_model"},
    "cdb_bench": {"cdb_scheduler", "cdb_model", "cdb_engine", "cdb_api", "services", "clients"},
    "cdb": {"cdb_scheduler", "cdb_model", "cdb_engine", "cdb_api", "services", "clients", "cdb_bench", "cdb_train"},
}
# Third-party packages a layer must not import.
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "cdb_scheduler": {"torch", "grpc", "numpy", "google", "opentelemetry"},
    "cdb_model": {"grpc", "opentelemetry"},
    "cdb_engine": {"grpc", "opentelemetry"},
    "clients": {"torch", "numpy"},
}
SERVICE_ROOMS = {
    "net": 0,
    "settings": 0,
    "healthcheck": 0,
    "stage_secret": 0,
    "reflection": 0,
    "version": 0,
    "heap": 0,
    "telemetry": 1,
    "transport": 2,
    "frontlink": 3,
    "api": 4,
    "http": 5,
    "frontend": 6,
    "launcher": 7,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[module_name(path)] = path
    return found


def imports_of(path: Path, name: str) -> set[str]:
    """Absolute names of everything ``path`` imports (relative imports resolved against ``name``)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def resolve(target: str, modules: Iterable[str]) -> str | None:
    """The project module ``target`` names (the longest module prefix), or None for a third-party one."""
    known = set(modules)
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project module -> project modules it imports, project module -> third-party top-level packages)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name], external[name] = set(), set()
        for target in imports_of(path, name):
            hit = resolve(target, modules)
            if hit is None:
                external[name].add(target.split(".")[0])
            elif hit != name:
                graph[name].add(hit)
    return graph, external


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def top(module: str) -> str:
    return module.split(".")[0]


def upward_arrows(graph: Mapping[str, Iterable[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            a, b = top(src), top(dst)
            if a != b and b not in ALLOWED[a]:
                bad.append(f"{src} -> {dst}")
            if a == b == "services":
                ra, rb = src.split(".")[1], dst.split(".")[1] if "." in dst else ""
                if ra != rb and rb and SERVICE_ROOMS[rb] > SERVICE_ROOMS[ra]:
                    bad.append(f"{src} -> {dst} (room {rb} is above room {ra})")
    return bad


def test_the_cycle_finder_and_the_layer_rule_can_fail() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert upward_arrows({"cdb_scheduler.x": {"cdb_engine.y"}}) == ["cdb_scheduler.x -> cdb_engine.y"]
    assert upward_arrows({"services.transport.a": {"services.api.b"}})
    assert upward_arrows({"services.api.b": {"services.transport.a"}}) == []


def test_the_graph_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import cdb\n"
        "def f():\n    from services.launcher import serve_all\n    import torch.nn\n    from . import x\n"
    )
    found = imports_of(src, "cdb_engine.m")
    assert found >= {"services.launcher", "services.launcher.serve_all", "torch.nn", "cdb_engine.x"}
    assert "cdb" not in found


def test_no_import_cycles_between_modules() -> None:
    graph, _ = import_graph()
    assert len(graph) > 50, "the walk found the project's modules"
    assert find_cycle(graph) is None


def test_no_import_from_a_lower_layer_into_a_higher_one() -> None:
    graph, _ = import_graph()
    assert upward_arrows(graph) == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN_THIRD_PARTY))
def test_layers_keep_out_of_the_libraries_of_higher_ones(package: str) -> None:
    _, external = import_graph()
    used = {m: sorted(ext & FORBIDDEN_THIRD_PARTY[package]) for m, ext in external.items() if top(m) == package}
    assert {m: e for m, e in used.items() if e} == {}


def test_nothing_outside_tests_imports_tests() -> None:
    _, external = import_graph()
    assert sorted(m for m, ext in external.items() if "tests" in ext) == []
