"""The packages' layering, read from their imports: contracts at the bottom, the runtime kit above them,
the services above both, and the developer tools on top; no package imports one above it, so there is no
cycle between packages."""

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
    "localmesh": {"chatmesh", "meshkit", "memory_store"},
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
