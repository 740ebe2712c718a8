"""`python -m router` as a plain process (run_forever): serves, then exits cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from router_fakes import FakeWorker

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_router_process_serves_and_stops(model_dir, tmp_path):
    worker = FakeWorker("d0", "colocated")
    workers = tmp_path / "workers.json"
    workers.write_text(
        json.dumps([{"worker_id": "d0", "role": "colocated", "request_endpoint": worker.endpoint}])
    )
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "router",
        model_dir,
        "--workers",
        str(workers),
        "--port",
        str(port),
        "--served-model-name",
        "m",
        "--api-key",
        "k3y",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    assert r.status == 200
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"router did not come up: {proc.stdout.read()}")
                time.sleep(0.2)
        req = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps({"model": "m", "prompt": [5, 6], "max_tokens": 3}).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer k3y"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "k3y" not in proc.stdout.read()  # the key is never logged
    finally:
        if proc.poll() is None:
            proc.kill()
        worker.close()
