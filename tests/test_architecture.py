"""The package boundaries: the import contracts in pyproject.toml hold, the file-cycle contract catches a
cycle, and only devices/ touches torch_npu or torch.version.hip (which import-linter cannot see)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import REPO

LINT_IMPORTS = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]
"""`lint-imports`, run by the interpreter running the tests."""


def lint_imports(*args: str, cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="240")  # few wrapped lines in the report
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return subprocess.run([*LINT_IMPORTS, "--no-logo", "--no-cache", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def test_the_import_contracts_hold():
    result = lint_imports(cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_cycle_between_two_files_breaks_the_file_contract(tmp_path):
    package = tmp_path / "loopy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text("from loopy.second import TWO\n\nONE = 1\n")
    (package / "second.py").write_text("TWO = 2\n\n\ndef one():\n    from loopy.first import ONE  # hidden in a function\n"
                                       "    return ONE\n")
    (package / "leaf.py").write_text("from loopy import first\n")
    config = tmp_path / "contracts.toml"
    config.write_text(textwrap.dedent("""\
        [tool.importlinter]
        root_package = "loopy"
        contract_types = ["file_acyclic: tools.import_contracts.FileAcyclicContract"]

        [[tool.importlinter.contracts]]
        name = "no import cycles between files"
        type = "file_acyclic"
        containers = ["loopy"]
        """))
    result = lint_imports("--config", str(config), cwd=tmp_path, pythonpath=str(REPO))
    out = " ".join((result.stdout + result.stderr).split())  # the report wraps long lines
    assert result.returncode == 1, out
    assert "no import cycles between files BROKEN" in out
    assert "loopy/first.py -> loopy/second.py -> loopy/first.py" in out
    assert "loopy.second imports loopy.first (loopy/second.py, l.5)" in out
    assert "leaf" not in out  # it imports into the cycle but is not part of it


def _vendor_probes(path: Path) -> list[str]:
    """Where `path` imports torch_npu (also by name, as importlib does) or reads torch.version.hip."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]  # importlib.import_module("torch_npu"), __import__(...)
        if any(n == "torch_npu" or n.startswith("torch_npu.") for n in names):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: torch_npu")
        if isinstance(node, ast.Attribute) and node.attr == "hip" and ast.unparse(node.value).endswith("version"):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
        if (isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) >= 2
                and ast.unparse(node.args[0]).endswith("version") and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "hip"):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_devices_touches_torch_npu_or_torch_version_hip():
    devices = REPO / "heteroflow" / "devices"
    outside, inside = [], []
    for path in sorted((REPO / "heteroflow").rglob("*.py")):
        (inside if devices in path.parents else outside).extend(_vendor_probes(path))
    assert not outside, "only heteroflow/devices/ may import torch_npu or read torch.version.hip; ask devices/:\n" + \
        "\n".join(outside)
    kinds = " ".join(inside)
    assert "torch_npu" in kinds and "hip" in kinds, inside  # the scan does see the probes where they belong


VENDOR_RUNTIMES = ("torch.cuda", "torch.npu", "torch.xpu", "torch.mps", "torch.version.cuda", "torch.backends.cuda",
                   "torch.backends.cudnn")
"""torch's per-vendor runtime modules: whoever names one has picked a vendor, which only `devices/` may do."""


def _vendor_runtime_uses(path: Path) -> list[str]:
    """Where `path` names a vendor runtime (`torch.cuda.synchronize()`, `from torch import cuda`, `import
    torch.npu`) or moves a tensor with `.cuda()` / `.npu()`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        named: list[str] = []
        if isinstance(node, ast.Attribute):
            named = [ast.unparse(node)]  # `torch.cuda` is its own node inside `torch.cuda.synchronize`
        elif isinstance(node, ast.Import):
            named = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            named = [f"{node.module}.{a.name}" for a in node.names]
        hits = [n for n in named if any(n == r or (not isinstance(node, ast.Attribute) and n.startswith(r + "."))
                                        for r in VENDOR_RUNTIMES)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("cuda", "npu"):
            hits.append(ast.unparse(node))
        found.extend(f"{path.relative_to(REPO)}:{node.lineno}: {hit}" for hit in hits)
    return found


def test_only_devices_names_a_vendor_runtime():
    """Everything else asks `devices.Device` (the facade), so an Ascend or ROCm machine runs its own accelerator
    where a direct `torch.cuda` call would silently fall back to the CPU (as `heteroflow profile` once did)."""
    devices = REPO / "heteroflow" / "devices"
    outside, inside = [], []
    for path in sorted((REPO / "heteroflow").rglob("*.py")):
        (inside if devices in path.parents else outside).extend(_vendor_runtime_uses(path))
    assert not outside, "only heteroflow/devices/ may name a vendor runtime; ask devices.Device:\n" + "\n".join(outside)
    assert any("torch.cuda" in use for use in inside) and any("torch.npu" in use for use in inside), inside
