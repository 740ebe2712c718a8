"""The layout rules of DESIGN.md, checked on the source (ast only, nothing imported):

- no Python file over 600 lines outside tests/;
- no function over 60 lines in kv_transfer/, router/, cluster/, bench/;
- imports only point down `cluster -> bench, router, prefill_worker, decode_worker ->
  kv_transfer -> engine` (function-local imports included: a lazy import up the layers is
  still an import up the layers), and the four middle packages never import each other;
- no import cycle between modules (module-level imports, the ones that run at import time).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYER = {
    "engine": 0,
    "kv_transfer": 1,
    "bench": 2,
    "router": 2,
    "prefill_worker": 2,
    "decode_worker": 2,
    "cluster": 3,
}
SHORT_FUNCTION_PACKAGES = ("kv_transfer", "router", "cluster", "bench")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def _sources(*roots: str) -> list[Path]:
    files = [p for root in roots for p in sorted((REPO / root).rglob("*.py"))]
    assert files, f"no Python files under {roots}: the scan would prove nothing"
    return files


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, top_level_only: bool) -> set[str]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif top_level_only and isinstance(node, ast.If | ast.Try) and not _type_only(node):
            out |= _imports(ast.Module(body=list(ast.iter_child_nodes(node))), module, True)
    return out


def _type_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` blocks never run."""
    test = getattr(node, "test", None)
    return isinstance(test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(test)


def _is_package(module: str) -> bool:
    return (REPO / module.replace(".", "/") / "__init__.py").exists()


def test_no_file_is_over_600_lines():
    roots = [*LAYER, "benchmarks"]
    long = {
        str(p.relative_to(REPO)): n
        for p in _sources(*roots)
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}


def test_no_function_is_over_60_lines():
    long = {}
    for path in _sources(*SHORT_FUNCTION_PACKAGES):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert long == {}


@pytest.mark.parametrize("package", sorted(LAYER))
def test_imports_point_down_the_layers(package):
    rank = LAYER[package]
    wrong = set()
    for path in _sources(package):
        module = _module_name(path)
        for name in _imports(ast.parse(path.read_text()), module, top_level_only=False):
            target = name.split(".")[0]
            if target in LAYER and target != package and LAYER[target] >= rank:
                wrong.add(f"{module} imports {name}")
    assert sorted(wrong) == []


def test_no_import_cycle():
    modules = {_module_name(p): p for p in _sources(*LAYER)}
    graph = {
        m: {
            n
            for n in _imports(ast.parse(p.read_text()), m, top_level_only=True)
            if n in modules and n != m
        }
        for m, p in modules.items()
    }
    assert sum(len(v) for v in graph.values()) > 50  # the scan found the real imports
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checks_catch_what_they_name(tmp_path):
    """The import scanner sees lazy, relative and conditional imports (so the layer test
    cannot pass by not looking)."""
    src = (
        "import engine.wire\n"
        "try:\n    from router import server\nexcept ImportError:\n    pass\n"
        "def f():\n    import cluster.serve\n"
    )
    tree = ast.parse(src)
    assert {"engine.wire", "router", "router.server"} <= _imports(tree, "x.y", True)
    assert "cluster.serve" not in _imports(tree, "x.y", True)
    assert "cluster.serve" in _imports(tree, "x.y", False)
