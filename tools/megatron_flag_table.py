"""Generate heteroflow/megatron/megatron_flags.tsv from Megatron-LM's megatron/training/arguments.py.

    git -C MEGATRON_GIT archive COMMIT megatron | tar -x -C SRC
    python tools/megatron_flag_table.py SRC COMMIT > heteroflow/megatron/megatron_flags.tsv

Only names, kinds and literal defaults are read, by walking syntax trees; no code is copied or run:
the `add_argument` calls of arguments.py, and the fields of the config dataclasses it hands to
`ArgumentGroupFactory` (which makes `--field-name`, and `--no-field-name` / `--disable-field-name`
for a bool that defaults to True). The first line records the commit. Non-literal defaults read `?`.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

_KINDS = {"int": "int", "float": "float", "str": "str"}


def _literal(node: ast.AST | None) -> object:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return "?"


def flag_rows(source: str) -> list[tuple[str, str, str, str]]:
    """(flag, dest, kind, default) for every `add_argument` call with `--` flags, in source order."""
    rows = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                 and a.value.startswith("--")]
        if not flags:
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        action = _literal(kw.get("action"))
        dest = _literal(kw.get("dest")) if "dest" in kw else flags[0][2:].replace("-", "_")
        nargs = _literal(kw.get("nargs"))
        type_name = kw["type"].id if isinstance(kw.get("type"), ast.Name) else None
        if action in ("store_true", "store_false"):
            kind = "true" if action == "store_true" else "false"
            default = _literal(kw.get("default")) if "default" in kw else (action == "store_false")
        else:
            kind = "list" if nargs in ("+", "*") else _KINDS.get(type_name or "str", "str")
            default = _literal(kw.get("default"))
        for flag in flags:
            rows.append((flag, str(dest), kind, repr(default)))
    return rows


def _classes(src: Path) -> dict[str, ast.ClassDef]:
    found: dict[str, ast.ClassDef] = {}
    for path in sorted((src / "megatron").rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, node)
    return found


def _annotation_kind(node: ast.AST) -> str:
    text = ast.unparse(node)
    if re.search(r"\b(list|List|tuple|Tuple)\[", text):
        return "list"
    for name in ("bool", "int", "float", "str"):
        if re.fullmatch(rf"(Optional\[)?{name}\]?|{name} \| None|None \| {name}", text):
            return "true" if name == "bool" else name
    return "str"


def _field_rows(cls: ast.ClassDef, classes: dict[str, ast.ClassDef], exclude: set[str]) -> list[tuple]:
    rows = []
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            rows += _field_rows(classes[base.id], classes, exclude)
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if name.startswith("_") or name in exclude or "ClassVar" in ast.unparse(node.annotation):
            continue
        default = node.value
        if isinstance(default, ast.Call) and ast.unparse(default.func).endswith("field"):
            kw = {k.arg: k.value for k in default.keywords}
            default = kw.get("default")
        value = _literal(default)
        kind = _annotation_kind(node.annotation)
        flag = "--" + name.replace("_", "-")
        if kind == "true" and value is True:
            rows += [("--no-" + flag[2:], name, "false", "True"), ("--disable-" + flag[2:], name, "false", "True")]
        else:
            rows.append((flag, name, kind, repr(value if kind != "true" else bool(value))))
    return rows


def factory_rows(arguments: str, classes: dict[str, ast.ClassDef]) -> list[tuple]:
    """Rows for the flags `ArgumentGroupFactory(ConfigClass, exclude=[...])` makes from dataclass fields."""
    rows = []
    for node in ast.walk(ast.parse(arguments)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ArgumentGroupFactory"
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in classes):
            kw = {k.arg: k.value for k in node.keywords}
            exclude = _literal(kw.get("exclude")) or []
            rows += _field_rows(classes[node.args[0].id], classes, set(exclude if isinstance(exclude, list) else []))
    return rows


def main(argv: list[str]) -> int:
    src, commit = Path(argv[0]), argv[1]
    arguments = (src / "megatron" / "training" / "arguments.py").read_text(encoding="utf-8")
    rows = flag_rows(arguments) + factory_rows(arguments, _classes(src))
    print(f"# Megatron-LM megatron/training/arguments.py at {commit}: flag, dest, kind, default (tools/megatron_flag_table.py)")
    seen = set()
    for row in rows:
        if row[0] not in seen:
            seen.add(row[0])
            print("\t".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
