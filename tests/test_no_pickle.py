"""No pickle anywhere a frame could come from (DESIGN.md: msgpack via the codec in
engine/protocol.py, never pickle), checked on the source with ast (nothing is imported), in
every package that runs in a worker, the router, the controller or the benchmarks:

- no import of a pickle-family module (pickle, cloudpickle, dill, marshal, shelve, ...),
  also through __import__ / importlib.import_module with a literal name;
- no pyzmq object helpers (send_pyobj, recv_pyobj, send_serialized, recv_serialized), called
  or looked up by name, and no pandas read_pickle;
- torch.load only with weights_only=True; no allow_pickle=True (numpy);
- msgpack is decoded only in the codec, engine/protocol.py (msgpack's unpackers and
  msgspec.msgpack's decoders), and there with a size check of the frame before unpacking: a
  `len(frame)` comparison before `msgpack.unpackb(frame, ...)` or any `<decoder>.decode(frame)`;
  msgpack's own also with raw=False and strict_map_key=True (an Unpacker also needs
  max_buffer_size).

A finding names file:line. The scanner is tested on planted violations, so a scan that finds
nothing proves something.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("engine", "kv_transfer", "router", "prefill_worker", "decode_worker", "cluster", "bench")
WIRE = "engine/protocol.py"  # the codec
PICKLE_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "pickletools",
    "cloudpickle",
    "dill",
    "marshal",
    "shelve",
    "copyreg",
    "jsonpickle",
    "joblib",
}
OBJECT_HELPERS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized", "read_pickle"}
MSGPACK_DECODERS = {"unpackb", "unpack", "loads", "load", "Unpacker"}
MSGSPEC_DECODERS = {"msgspec.msgpack.decode", "msgspec.msgpack.Decoder"}


class _Scan(ast.NodeVisitor):
    """One file's findings. Names bound by imports are collected first (an import may sit
    below its use, or inside a function), then every call is checked."""

    def __init__(self, rel: str, tree: ast.AST):
        self.rel = rel
        self.findings: list[str] = []
        self.torch: set[str] = set()  # names bound to the torch module
        self.torch_load: set[str] = set()  # names bound to torch.load
        self.msgpack: set[str] = set()
        self.msgpack_decoders: set[str] = set()
        self.msgspec: dict[str, str] = {"msgspec": "msgspec"}  # bound name -> dotted path
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.Import | ast.ImportFrom):
                self._imports(node)

    def report(self, node: ast.AST, what: str) -> None:
        self.findings.append(f"{self.rel}:{node.lineno}: {what}")

    def _imports(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                root = a.name.split(".")[0]
                bound = a.asname or root
                if root in PICKLE_MODULES:
                    self.report(node, f"imports {a.name}")
                elif a.name == "torch" or (root == "torch" and a.asname is None):
                    self.torch.add(bound)
                elif a.name == "msgpack" or (root == "msgpack" and a.asname is None):
                    self.msgpack.add(bound)
                elif root == "msgspec":
                    self.msgspec[bound] = a.name if a.asname else root
            return
        module = node.module or ""
        root = module.split(".")[0]
        for a in node.names:
            if root in PICKLE_MODULES or (not module and a.name in PICKLE_MODULES):
                self.report(node, f"imports {a.name} from {module or '.'}")
            elif module == "torch" and a.name == "load":
                self.torch_load.add(a.asname or a.name)
            elif module == "msgpack" and a.name in MSGPACK_DECODERS:
                self.msgpack_decoders.add(a.asname or a.name)
            elif root == "msgspec":
                self.msgspec[a.asname or a.name] = f"{module}.{a.name}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in OBJECT_HELPERS:
            self.report(node, f"uses .{node.attr} (pickles objects)")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else None
        owner = (
            func.value.id
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            else None
        )
        attr = func.attr if isinstance(func, ast.Attribute) else None
        self._dynamic_import(node, name, attr)
        if (owner in self.torch and attr == "load") or name in self.torch_load:
            if not _keyword_is(node, "weights_only", True):
                self.report(node, "torch.load without weights_only=True (unpickles)")
        if (owner in self.msgpack and attr in MSGPACK_DECODERS) or name in self.msgpack_decoders:
            self._msgpack_decode(node, attr or name)
        dotted = self._msgspec_path(func)
        if dotted in MSGSPEC_DECODERS and self.rel != WIRE:
            self.report(node, f"{dotted} outside {WIRE} (decode frames with engine.protocol)")
        if self.rel == WIRE and attr == "decode" and not self._size_checked(node):
            if isinstance(node.args[0] if node.args else None, ast.Name):
                self.report(node, f"{ast.unparse(func)} without a size check of its frame first")
        if any(k.arg == "allow_pickle" and _is_true(k.value) for k in node.keywords):
            self.report(node, "allow_pickle=True")
        self.generic_visit(node)

    def _dynamic_import(self, node: ast.Call, name: str | None, attr: str | None) -> None:
        if name in ("__import__", "import_module") or attr == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if arg.value.split(".")[0] in PICKLE_MODULES:
                    self.report(node, f"imports {arg.value} dynamically")
        if name == "getattr" and len(node.args) >= 2:
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and arg.value in OBJECT_HELPERS:
                self.report(node, f"looks up {arg.value} (pickles objects)")

    def _msgspec_path(self, func: ast.expr) -> str | None:
        """`msgspec.msgpack.Decoder` for `mm.Decoder` after `import msgspec.msgpack as mm`."""
        parts = []
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        if not isinstance(func, ast.Name) or func.id not in self.msgspec:
            return None
        return ".".join([self.msgspec[func.id], *reversed(parts)])

    def _msgpack_decode(self, node: ast.Call, decoder: str) -> None:
        if self.rel != WIRE:
            self.report(
                node, f"msgpack.{decoder} outside {WIRE} (decode frames with engine.protocol)"
            )
            return
        needed = [("raw", False), ("strict_map_key", True)]
        if decoder == "Unpacker":
            needed.append(("max_buffer_size", None))
        for key, value in needed:
            if not _keyword_is(node, key, value):
                self.report(node, f"msgpack.{decoder} without {key}={value}")
        if decoder != "Unpacker" and not self._size_checked(node):
            self.report(node, f"msgpack.{decoder} without a size check of its frame first")

    def _size_checked(self, node: ast.Call) -> bool:
        """Whether the enclosing function compares len(<the frame>) before this call."""
        frame = node.args[0] if node.args else None
        if not isinstance(frame, ast.Name):
            return False
        scope = self.parents.get(node)
        while scope is not None and not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            scope = self.parents.get(scope)
        if scope is None:
            return False
        for cmp in ast.walk(scope):
            if isinstance(cmp, ast.Compare) and cmp.lineno <= node.lineno:
                for side in (cmp.left, *cmp.comparators):
                    if (
                        isinstance(side, ast.Call)
                        and isinstance(side.func, ast.Name)
                        and side.func.id == "len"
                        and side.args
                        and isinstance(side.args[0], ast.Name)
                        and side.args[0].id == frame.id
                    ):
                        return True
        return False


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _keyword_is(call: ast.Call, key: str, value: object) -> bool:
    """`key=value` is passed literally (value None: passed at all)."""
    for k in call.keywords:
        if k.arg == key:
            return value is None or (isinstance(k.value, ast.Constant) and k.value.value is value)
    return False


def scan_source(source: str, rel: str) -> list[str]:
    tree = ast.parse(source, filename=rel)
    scan = _Scan(rel, tree)
    scan.visit(tree)
    return scan.findings


def _sources() -> list[Path]:
    files = [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]
    assert len(files) > 50, f"only {len(files)} files under {ROOTS}: the scan would prove little"
    return files


def test_no_pickle_in_the_serving_packages():
    findings = []
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        findings += scan_source(path.read_text(encoding="utf-8"), rel)
    assert not findings, "pickle-capable code:\n" + "\n".join(findings)


def test_the_wire_module_is_scanned_and_passes():
    """engine/protocol.py (the codec) really unpacks msgpack (msgspec's typed decoders): the rules for it are
    exercised, not vacuous."""
    source = (REPO / WIRE).read_text(encoding="utf-8")
    assert "msgspec.msgpack.Decoder(" in source and ".decode(frame)" in source
    assert scan_source(source, WIRE) == []
    assert scan_source(source, "engine/elsewhere.py") != []
    unchecked = source.replace("if len(frame) > max_bytes:", "if max_bytes < 0:")
    assert any("size check" in f for f in scan_source(unchecked, WIRE))


PLANTED = {
    "import pickle": "imports pickle",
    "import cloudpickle as cp": "imports cloudpickle",
    "from dill import dumps": "imports dumps from dill",
    "import marshal": "imports marshal",
    "from . import pickle": "imports pickle from .",
    "mod = __import__('pickle')": "imports pickle dynamically",
    "import importlib\nmod = importlib.import_module('_pickle')": "imports _pickle dynamically",
    "sock.send_pyobj({'a': 1})": "uses .send_pyobj",
    "obj = sock.recv_pyobj()": "uses .recv_pyobj",
    "sock.send_serialized(x, f)": "uses .send_serialized",
    "fn = getattr(sock, 'recv_serialized')": "looks up recv_serialized",
    "import torch\nsd = torch.load(p)": "torch.load without weights_only=True",
    "import torch as T\nsd = T.load(p, weights_only=False)": "torch.load without weights_only",
    "from torch import load as tl\nsd = tl(p)": "torch.load without weights_only=True",
    "import numpy as np\na = np.load(p, allow_pickle=True)": "allow_pickle=True",
    "import msgpack\nd = msgpack.unpackb(b, raw=False, strict_map_key=True)": "outside engine",
    "from msgpack import Unpacker\nu = Unpacker(f)": "msgpack.Unpacker outside",
    "import msgspec\nd = msgspec.msgpack.Decoder(dict)": "msgspec.msgpack.Decoder outside",
    "import msgspec.msgpack as mm\nd = mm.Decoder(dict)": "msgspec.msgpack.Decoder outside",
    "from msgspec import msgpack as m\nx = m.decode(b)": "msgspec.msgpack.decode outside",
    "from msgspec.msgpack import decode as d\nx = d(b)": "msgspec.msgpack.decode outside",
}


@pytest.mark.parametrize("snippet", sorted(PLANTED))
def test_the_scanner_finds_a_planted_violation(tmp_path, snippet):
    source = f"x = 1\n\n\ndef f(sock, p, b, f, x):\n{textwrap.indent(snippet, '    ')}\n"
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    findings = scan_source(planted.read_text(), "router/planted.py")
    assert findings, f"missed: {snippet!r}"
    lines = source.splitlines()
    last = len(lines)  # the violating statement is the snippet's last line
    assert any(f.startswith(f"router/planted.py:{last}: ") for f in findings), findings
    assert any(PLANTED[snippet] in f for f in findings), findings


@pytest.mark.parametrize(
    ("body", "missing"),
    [
        ("return msgpack.unpackb(frame, strict_map_key=True)", "raw=False"),
        ("return msgpack.unpackb(frame, raw=False)", "strict_map_key=True"),
        ("return msgpack.unpackb(frame, raw=False, strict_map_key=True)", "size check"),
        (
            "if len(frame) > 9:\n        raise ValueError\n"
            "    return msgpack.Unpacker(frame, raw=False, strict_map_key=True)",
            "max_buffer_size",
        ),
        ("return _ENVELOPE.decode(frame)", "size check"),
        ("return msgspec.msgpack.decode(frame, type=T)", "size check"),
    ],
)
def test_the_scanner_holds_the_wire_module_to_its_limits(body, missing):
    source = f"import msgpack\n\n\ndef decode(frame):\n    {body}\n"
    findings = scan_source(source, WIRE)
    assert any(missing in f for f in findings), findings


def test_the_scanner_accepts_safe_code():
    source = textwrap.dedent(
        """
        import msgpack
        import torch
        import numpy as np

        def ok(frame, p, sock):
            sd = torch.load(p, weights_only=True, map_location="cpu")
            a = np.load(p)
            sock.send(msgpack.packb({"v": 1}))
            return sd, a
        """
    )
    assert scan_source(source, "bench/ok.py") == []
