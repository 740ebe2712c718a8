"""The layout rules of DESIGN.md, checked on the source (ast only, nothing imported):

- no Python file over 600 lines outside tests/;
- no function over 60 lines in kv_transfer/, router/, cluster/, bench/;
- imports only point down `cluster -> bench, router, prefill_worker, decode_worker ->
  kv_transfer, tools -> engine` (function-local imports included: a lazy import up the layers
  is still an import up the layers), and the four middle packages never import each other;
- tools/ (checkpoint making, not runtime code) is imported by cluster, bench, benchmarks and
  tests only, never by a serving package.
(The no-import-cycle rule is tests/test_import_graph.py's.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYER = {
    "engine": 0,
    "kv_transfer": 1,
    # Not runtime code (tandem make-model and its corpus): beside bench in the layering, but
    # below it, since bench (tandem profile) imports it.
    "tools": 1,
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


def _imports(tree: ast.AST, module: str) -> set[str]:
    """Every module `tree` imports, wherever the import statement sits."""
    out: set[str] = set()
    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


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


# The packages a serving process is built from: none of them may import tools/.
RUNTIME_PACKAGES = ("engine", "kv_transfer", "router", "prefill_worker", "decode_worker")


@pytest.mark.parametrize("package", RUNTIME_PACKAGES)
def test_runtime_packages_never_import_tools(package):
    wrong = {
        f"{_module_name(path)} imports {name}"
        for path in _sources(package)
        for name in _imports(ast.parse(path.read_text()), _module_name(path))
        if name.split(".")[0] == "tools"
    }
    assert sorted(wrong) == []


@pytest.mark.parametrize("package", sorted(LAYER))
def test_imports_point_down_the_layers(package):
    rank = LAYER[package]
    wrong = set()
    for path in _sources(package):
        module = _module_name(path)
        for name in _imports(ast.parse(path.read_text()), module):
            target = name.split(".")[0]
            if target in LAYER and target != package and LAYER[target] >= rank:
                wrong.add(f"{module} imports {name}")
    assert sorted(wrong) == []


def test_the_import_scanner_sees_lazy_relative_and_conditional_imports():
    """So the layer test cannot pass by not looking."""
    src = (
        "import engine.protocol\n"
        "from .sibling import thing\n"
        "try:\n    from router import server\nexcept ImportError:\n    pass\n"
        "def f():\n    import cluster.serve\n"
    )
    found = _imports(ast.parse(src), "kv_transfer.agent")
    assert {"engine.protocol", "router.server", "cluster.serve", "kv_transfer.sibling"} <= found
