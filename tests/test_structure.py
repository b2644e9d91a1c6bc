"""The package's structure: no import cycles, and imports that follow the flow."""

from __future__ import annotations

import ast
from pathlib import Path

import remat

PACKAGE = Path(remat.__file__).resolve().parent

# The layers of remat, lowest first: a module may import modules of its own layer or of a
# lower one, never of a higher one (the data flows discover -> measure -> plan -> execute,
# and measurement runs the executor for its frugal mode, so it sits above it).
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "remat.errors",
        "remat.units",
        "remat.storages",
        "remat.sharded",
        "remat.budget",
        "remat.memory",
        "remat.ranks",
        "remat._inherited",
        "remat._no_grad",
    ),
    ("remat.manual",),
    ("remat.discover",),
    ("remat.plan", "remat.testing"),
    ("remat.execute",),
    ("remat.measure",),
    ("remat.wrapper", "remat.traced"),
    ("remat.automatic", "remat.enable"),
    ("remat.models",),
    ("remat.bench",),
    ("remat.cli",),
    ("remat", "remat.__main__", "remat.policies"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def runtime_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The remat modules a module imports when it runs (at import time or in a function)."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if _is_type_checking_block(node):
            continue
        pending.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "remat")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "remat":
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: runtime_imports(path, modules) - {name} for name, path in modules.items()}


def test_the_graph_is_read_from_the_sources() -> None:
    graph = import_graph()
    assert "remat.manual.recompute" in graph["remat.manual.marking"]
    assert "remat.discover.intercept" in graph["remat.execute"]


def test_src_has_no_import_cycles() -> None:
    graph = import_graph()
    # Tarjan's strongly connected components: any component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert cycles == []


def layer_of(module: str) -> int:
    best = -1
    best_length = -1
    for position, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = position, len(prefix)
    assert best >= 0, f"{module} is in no layer of LAYERS"
    return best


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{source} imports {target}"
        for source, targets in import_graph().items()
        for target in targets
        if layer_of(target) > layer_of(source) and target != "remat"
    ]
    assert upward == []


def test_no_module_is_over_six_hundred_lines() -> None:
    long = {name: len(path.read_text().splitlines()) for name, path in all_modules().items()}
    assert {name: lines for name, lines in long.items() if lines > 600} == {}
