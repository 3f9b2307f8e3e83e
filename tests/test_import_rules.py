"""The import rules of docs/ARCHITECTURE.md, read from the source: which package may import which,
no circle among the engine's modules, and the kernels below everything else. Every import
counts: at the top of a module, inside a function, or for type checking only (a circle of
type-only imports is still two modules that cannot be read one after the other)."""

from __future__ import annotations

import ast
from pathlib import Path

import sluice

ROOT = Path(sluice.__file__).parent

# Which sluice packages each may import (besides itself); cli, testing (the harnesses tests and
# benchmarks share) and the entry point may import them all.
ALLOWED = {
    "schemas": set(),
    "engine": set(),
    "connectors": {"schemas"},
    "actors": {"engine", "connectors", "schemas"},
    "tools": {"connectors", "schemas"},
    "harness": {"connectors", "schemas"},
}


def _modules() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = ("sluice", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


MODULES = _modules()


def _resolve(name: str, node: ast.Import | ast.ImportFrom) -> list[tuple[str, int]]:
    """(module imported, line) for one import statement of module `name`, relative ones
    resolved; for `from package import name` the submodule where `name` is one."""
    if isinstance(node, ast.Import):
        return [(alias.name, node.lineno) for alias in node.names]
    package = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
    base = package[: len(package) - node.level + 1] if node.level else []
    module = ".".join(base + ([node.module] if node.module else []))
    subs = [f"{module}.{alias.name}" for alias in node.names]
    return [(sub if sub in MODULES else module, node.lineno) for sub in subs]


def _imports(name: str) -> list[tuple[str, int]]:
    """Every sluice module that module `name` imports, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += _resolve(name, node)
    return [(m, line) for m, line in found if m == "sluice" or m.startswith("sluice.")]


def test_each_package_imports_only_the_packages_below_it():
    wrong = []
    for name in MODULES:
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in ALLOWED:
            continue
        own = parts[1]
        for imported, line in _imports(name):
            other = imported.split(".")[1] if imported.count(".") else None
            if other is not None and other != own and other not in ALLOWED[own]:
                wrong.append(f"{name}:{line} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_only_tests_and_benchmarks_import_sluice_testing():
    wrong = [
        f"{name}:{line} imports {imported}"
        for name in MODULES
        if not name.startswith("sluice.testing")
        for imported, line in _imports(name)
        if imported == "sluice.testing" or imported.startswith("sluice.testing.")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_kernels_import_nothing_of_the_engine_above_them_at_run_time():
    """kernels/ and cpu_kernels/ hold kernels and their references: they may name an engine type
    for type checking, never import an engine module to run."""
    wrong = []
    for name in MODULES:
        package = ".".join(name.split(".")[:3])
        if package not in ("sluice.engine.kernels", "sluice.engine.cpu_kernels"):
            continue
        tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
        type_only = {
            id(node)
            for block in tree.body
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for node in ast.walk(block)
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in type_only:
                for imported, line in _resolve(name, node):
                    inside = imported.startswith(package) or not imported.startswith("sluice.")
                    if not inside:
                        wrong.append(f"{name}:{line} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_no_circle_among_the_engines_modules():
    engine = [m for m in MODULES if m.startswith("sluice.engine.")]
    edges = {m: {i for i, _ in _imports(m) if i in MODULES and i != m} for m in engine}
    circles = []
    # a module is in a circle when it can reach itself
    for start in engine:
        seen, todo = set(), [(start, [start])]
        while todo:
            module, path = todo.pop()
            for nxt in edges.get(module, ()):
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                    todo.clear()
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, [*path, nxt]))
    assert not circles, "\n".join(sorted(circles))
