"""sluice.testing is for the tests and the benchmarks: no other part of sluice imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import sluice

PACKAGE = Path(sluice.__file__).parent


def _imported(path: Path) -> list[str]:
    """Every module name `path` imports, relative imports resolved."""
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if package[-1] != "__init__":
        package.pop()
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names += [module, *(f"{module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_nothing_outside_sluice_testing_imports_it():
    checked = 0
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "testing":
            continue
        checked += 1
        for name in _imported(path):
            assert name != "sluice.testing" and not name.startswith("sluice.testing."), (
                f"{path.relative_to(PACKAGE.parent)} imports {name}"
            )
    assert checked > 100  # the whole package was read
