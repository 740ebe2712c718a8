"""The import graph of tandem's packages: no cycles among module-level imports, those under
`if TYPE_CHECKING:` included (a type-check-time cycle is the same tangle, hidden from the
interpreter but not from a type checker or a reader), nor once function-local imports are added
(a lazy import that closes a cycle is a cycle dodged, not removed); and the quantization math
stays a leaf. Read from the sources with `ast` (nothing is imported), so a cycle shows up as a
failing test rather than as a partially initialised module at some later import."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "engine"
PACKAGES = (
    "engine",
    "kv_transfer",
    "bench",
    "router",
    "prefill_worker",
    "decode_worker",
    "cluster",
    "tools",
)


def _module_names() -> dict[str, Path]:
    """Dotted name -> source file for every module of tandem's packages."""
    out = {}
    for path in (p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_nodes(
    body: list[ast.stmt], type_checking: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported: top level, inside top-level
    if/try/with blocks and class bodies; not inside functions. Those under TYPE_CHECKING
    only with `type_checking`."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if type_checking or not _is_type_checking(node):
                found += _import_time_nodes(node.body, type_checking)
            found += _import_time_nodes(node.orelse, type_checking)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                found += _import_time_nodes(block, type_checking)
            for handler in node.handlers:
                found += _import_time_nodes(handler.body, type_checking)
        elif isinstance(node, ast.With | ast.ClassDef):
            found += _import_time_nodes(node.body, type_checking)
    return found


def _all_import_nodes(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it sits (function bodies and TYPE_CHECKING too)."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool) -> list[str]:
    """Dotted names a statement imports; `from pkg import sub` names the submodule."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        package = module.split(".") if is_pkg else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _edges(tree: ast.Module, name: str, is_pkg: bool, known, scope: str) -> set[str]:
    """The modules of `known` that module `name` imports. `scope`: "import_time" (what runs on
    import), "type_checking" (that plus `if TYPE_CHECKING:` blocks) or "all" (function-local
    imports too)."""
    if scope == "all":
        nodes = _all_import_nodes(tree)
    else:
        nodes = _import_time_nodes(tree.body, type_checking=scope == "type_checking")
    targets = {t for node in nodes for t in _targets(node, name, is_pkg)}
    return {t for t in targets if t in known and t != name}


def _graph(scope: str = "import_time") -> dict[str, set[str]]:
    modules = _module_names()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = _edges(tree, name, path.name == "__init__.py", modules, scope)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge found by a depth-first search (empty when acyclic)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_module_level_imports_have_no_cycle():
    graph = _graph()
    assert "engine.models.llama" in graph and graph["engine.models.llama"]
    assert sum(len(edges) for edges in graph.values()) > 100  # the scan found the imports
    assert _cycles(graph) == []


def test_type_checking_imports_have_no_cycle():
    graph = _graph("type_checking")
    # The scan sees TYPE_CHECKING blocks: an edge that only exists under one.
    only_typing = graph["bench.capacity_steps"] - _graph()["bench.capacity_steps"]
    assert "bench.capacity_config" in only_typing
    assert _cycles(graph) == []


def test_no_cycle_even_through_function_local_imports():
    graph = _graph("all")
    assert "engine.structured" in graph["engine.llm_engine"]  # a function-local edge is seen
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_type_checking_and_lazy_cycles():
    """So the cycle tests cannot pass by not looking."""
    sources = {
        "pkg.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n",
        "pkg.b": "import pkg.a\ndef f():\n    from pkg import c\n",
        "pkg.c": "from . import b\n",
    }

    def cycles(scope: str) -> list[list[str]]:
        return _cycles(
            {
                name: _edges(ast.parse(src), name, False, sources, scope)
                for name, src in sources.items()
            }
        )

    assert cycles("import_time") == []
    assert cycles("type_checking") == [["pkg.a", "pkg.b", "pkg.a"]]
    assert ["pkg.b", "pkg.c", "pkg.b"] in cycles("all")


QUANT_MODULES = (
    "engine.quantization",
    "engine.quantization.int8",
    "engine.quantization.fp8",
    "engine.quantization.checkpoint",
)


def test_quantization_is_a_leaf():
    """The quantization package imports only itself (and torch): configuration code can
    validate a setting or read a checkpoint's quantization_config without the model code."""
    graph = _graph()
    for mod in QUANT_MODULES:
        assert graph[mod] <= set(QUANT_MODULES), (mod, graph[mod])
    assert "engine.quantization.int8" in graph["engine.quantization"]
    assert "engine.models.linear" in graph["engine.models.llama"]
    assert {"engine.quantization", "engine.quantization.fp8"} <= graph["engine.models.linear"]


def test_model_and_quantization_modules_import_each_other_at_module_level_only():
    """No function-local engine imports in these: they were how a cycle was dodged."""
    for rel in ("models/llama.py", "models/linear.py", "quantization/__init__.py", "config.py"):
        tree = ast.parse((ENGINE / rel).read_text())
        top = set(map(id, _import_time_nodes(tree.body)))
        local = [
            ast.unparse(n)
            for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom)
            and id(n) not in top
            and "engine" in ast.unparse(n)
        ]
        assert local == [], (rel, local)
