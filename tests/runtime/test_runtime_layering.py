"""The worker side (`heteroflow.runtime`) never imports the launcher side (`heteroflow.launcher`)."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "heteroflow" / "runtime"


def test_no_runtime_module_imports_the_launcher():
    found = []
    for path in sorted(RUNTIME.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.name}: {n}" for n in names if n == "heteroflow.launcher" or
                      n.startswith("heteroflow.launcher.")]
    assert not found
