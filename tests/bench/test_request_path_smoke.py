"""benchmarks/request_path.py: a real run on this working tree (router, prefill and decode
workers with real NIXL agents, one process; about 10 s on an idle 2-core box) and the file
filter it prints from."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks.request_path import serving_files  # noqa: E402


@pytest.mark.slow
def test_one_remote_request_lists_the_files_it_passed_through(
    make_tiny_model, tmp_path: Path
) -> None:
    model = make_tiny_model("llama")
    out = tmp_path / "request_path.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "request_path.py")]
    cmd += ["--model", str(model), "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    result = json.loads(out.read_text())
    assert Path(result["tree"]) == REPO
    assert result["path"] == "remote" and result["completion_tokens"] == 8
    files = result["files"]
    assert files and len(set(files)) == len(files)
    for f in ("router/server.py", "engine/engine_server.py", "kv_transfer/decode_connector.py"):
        assert f in files, (f, files)
    assert result["count"] == len(files)
    assert result["forward_files"] and set(result["forward_files"]) <= set(files)
    printed = re.search(r"^files: (\d+) in .*\((\d+) of them the model forward", proc.stdout, re.M)
    assert printed, proc.stdout
    assert int(printed.group(1)) == len(files) and int(printed.group(2)) == result["forward_count"]
    numbered = re.findall(r"^\s*\d+\. (\S+)", proc.stdout, re.M)
    assert numbered == files


def test_only_files_of_the_serving_packages_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    seen = [
        (str(root / "router" / "server.py"), "MainThread"),
        (str(root / "cluster" / "cli.py"), "MainThread"),  # not a serving package
        (str(tmp_path / "site-packages" / "aiohttp" / "web.py"), "MainThread"),
        (str(root / "engine" / "models" / "llama.py"), "engine-p0"),
        ("<frozen importlib._bootstrap>", "MainThread"),
    ]
    assert serving_files(seen, root) == [
        ("router/server.py", "MainThread"),
        ("engine/models/llama.py", "engine-p0"),
    ]
