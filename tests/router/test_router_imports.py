"""The router runs beside no model: importing it must not load torch (a second or more of start-up
and hundreds of MB per router process). Checked in a fresh interpreter, since this test session
has long since imported torch for other suites."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Imports every router module (router.__main__ included: what `python -m router` loads before it
# serves) and reports whether torch got in, with the stack of whoever pulled it first.
_PROBE = """
import importlib, json, pkgutil, sys, traceback

first = []

class TorchSpy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not first:
            first.append("".join(traceback.format_stack()))
        return None

sys.meta_path.insert(0, TorchSpy())
import router
import router.server
import router.__main__
for module in pkgutil.iter_modules(router.__path__):
    importlib.import_module(f"router.{module.name}")
print(json.dumps({"torch": "torch" in sys.modules, "first": first[0] if first else ""}))
"""


def test_router_imports_without_torch():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert not report["torch"], f"importing the router loaded torch:\n{report['first']}"
