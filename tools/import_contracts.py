"""Custom import-linter contracts for heteroflow (registered in pyproject.toml under `[tool.importlinter]`).

import-linter's own `acyclic_siblings` contract compares packages with everything under them; heteroflow's
rule is about files: no two modules may import each other, directly or through others. `FileAcyclicContract`
checks that on the import graph import-linter builds, which holds every import statement of a module,
function-level ones included (a cycle hidden in a function still fails), and `TYPE_CHECKING` ones too
unless `exclude_type_checking_imports` is set for the session.

`lint-imports` puts the current directory on `sys.path`, so run it from the repository root; this
module is not part of the shipped package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from grimp import ImportGraph
from importlinter.application import contract_utils, output
from importlinter.application.contract_utils import AlertLevel
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def import_cycles(graph: ImportGraph, containers: list[str]) -> list[list[str]]:
    """Every import cycle between modules of `containers` (packages, their modules included), each as the
    modules of one cycle in import order, `[a, b, c]` meaning a imports b, b imports c, c imports a.

    One cycle per strongly connected component of the graph (Tarjan's algorithm, iterative), starting
    at the component's first module by name, so the output is stable."""
    modules: set[str] = set()
    for container in containers:
        modules |= {container} | graph.find_descendants(container)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & modules - {m}) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(_one_cycle(edges, set(c)) for c in components)


def _one_cycle(edges: dict[str, list[str]], component: set[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth first inside the component)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in edges[node]:
                if nxt not in component:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in a strongly connected component")


def module_file(module: str) -> str:
    """The file of `module`, relative to the directory that holds its top-level package (found without
    importing anything)."""
    parts = module.split(".")
    spec = importlib.util.find_spec(parts[0])
    if spec is None or not spec.submodule_search_locations:
        return module.replace(".", "/") + ".py"
    top = Path(next(iter(spec.submodule_search_locations)))
    path = top.joinpath(*parts[1:])
    file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return str(file.relative_to(top.parent))


class FileAcyclicContract(Contract):
    """No import cycles between the modules (files) of `containers`.

    Options: `containers` (packages to check, each with all its modules), `ignore_imports` (imports to
    leave out, as in import-linter's own contracts; say why next to each), and
    `unmatched_ignore_imports_alerting` (none, warn or error when an ignored import is not found).
    """

    type_name = "file_acyclic"

    containers = fields.ListField(subfield=fields.StringField())
    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)
    unmatched_ignore_imports_alerting = fields.EnumField(AlertLevel, default=AlertLevel.ERROR)

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        """Kept when the modules of `containers` import each other in no cycle."""
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph, ignore_imports=self.ignore_imports,  # type: ignore[arg-type]
            unmatched_alerting=self.unmatched_ignore_imports_alerting)  # type: ignore[arg-type]
        cycles = import_cycles(graph, list(self.containers))  # type: ignore[arg-type]
        details = [[(m, nxt, [d["line_number"] for d in graph.get_import_details(importer=m, imported=nxt)])
                    for m, nxt in zip(cycle, cycle[1:] + cycle[:1])] for cycle in cycles]
        return ContractCheck(kept=not cycles, warnings=list(removal.warnings),
                             ignored_import_count=removal.ignored_import_count,
                             metadata={"cycles": cycles, "details": details})

    def render_broken_contract(self, check: ContractCheck) -> None:
        """One block per cycle: its files, then each import of the cycle with its line numbers."""
        for cycle, imports in zip(check.metadata["cycles"], check.metadata["details"]):
            output.print_error(f"Import cycle between {len(cycle)} files: "
                               + " -> ".join(module_file(m) for m in cycle + cycle[:1]), bold=True)
            for importer, imported, lines in imports:
                where = ", ".join(f"l.{n}" for n in lines) or "?"
                output.indent_cursor()
                output.print_error(f"{importer} imports {imported} ({module_file(importer)}, {where})",
                                   bold=False)
            output.new_line()
