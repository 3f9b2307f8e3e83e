"""sluice.schemas depends on pydantic and the standard library only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sluice.schemas

PACKAGE = Path(sluice.schemas.__file__).parent


def test_no_imports_of_other_sluice_packages():
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                if node.level:
                    assert node.level == 1, f"{path.name} reaches out of sluice.schemas"
                    continue
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top != "sluice", f"{path.name} imports {name}"
                assert top in sys.stdlib_module_names or top in ("pydantic", "pydantic_core"), (
                    f"{path.name} imports {name}"
                )


def test_importing_schemas_loads_no_other_sluice_module():
    code = (
        "import sys, sluice.schemas\n"
        "bad = [m for m in sys.modules if m.startswith('sluice') and m != 'sluice' "
        "and not m.startswith('sluice.schemas')]\n"
        "heavy = [m for m in ('torch', 'aiokafka', 'redis', 'numpy') if m in sys.modules]\n"
        "assert not bad and not heavy, (bad, heavy)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
