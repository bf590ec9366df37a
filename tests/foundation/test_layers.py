"""The packages' layering, read from their imports: contracts at the bottom, the runtime kit above them,
the services above both, and the developer tools on top; no package imports one above it, so there is no
cycle between packages. Inside a package no modules import each other in a cycle either (an import inside a
function counts: it only hides the cycle from the interpreter, not from a reader)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What each package may import of the project's own packages (no service may import localmesh).
ALLOWED = {
    "chatmesh": set(),
    "meshkit": {"chatmesh"},
    "memory_store": {"chatmesh", "meshkit"},
    "engine": {"chatmesh", "meshkit"},
    "router": {"chatmesh", "meshkit"},
    "orchestrator": {"chatmesh", "meshkit", "memory_store"},
    "edge": {"chatmesh", "meshkit"},
    # The developer tools, on top: they start the services as processes, and read the orchestrator's
    # defaults where a load must build the prompts it assembles (localmesh/chaos/tool_load.py).
    "localmesh": {"chatmesh", "meshkit", "memory_store", "orchestrator"},
}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package: str):
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        extra = _imported_packages(path) - ALLOWED[package] - {package}
        if extra:
            wrong[str(path.relative_to(ROOT))] = sorted(extra)
    assert not wrong, f"{package} imports packages above its layer: {wrong}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of ``package`` it imports, anywhere in its body."""
    paths = {_module_name(path): path for path in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from a.b import c` imports the module a.b.c when there is one, else names of a.b
                targets = [
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in paths else node.module
                    for alias in node.names
                ]
            else:
                continue
            graph[name].update(target for target in targets if target in paths and target != name)
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (depth-first search for an edge back into the current path), or []."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        path.append(module)
        for imported in sorted(graph[module]):
            if imported in path:
                return [*path[path.index(imported) :], imported]
            if imported not in done and (cycle := visit(imported)):
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)):
            return cycle
    return []


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_modules_of_a_package_import_each_other_in_a_cycle(package: str):
    cycle = _a_cycle(_module_imports(package))
    assert not cycle, f"import cycle in {package}: {' -> '.join(cycle)}"
