"""Fixtures that run the real `tandem serve` (local Ray, real actors, NIXL, ZMQ, HTTP) as a
subprocess, and helpers to read its Prometheus metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class ServeProcess:
    def __init__(self, model: Path, tmp: Path, *args: str):
        self.ready = tmp / "ready.json"
        self.log_path = tmp / "serve.log"
        cmd = [
            sys.executable,
            "-m",
            "cluster.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            "0",
            "--num-cpus",
            "2",
            "--ready-file",
            str(self.ready),
            *args,
        ]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.time() + 180
        while not self.ready.exists():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"tandem serve did not start:\n{self.log_path.read_text()}")
            time.sleep(0.5)
        self.url = json.loads(self.ready.read_text())["url"]

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(tandem_[a-z_]+(?:\{[^}]*\})?) ([-0-9.e+]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_all_blocks_free(self, timeout: float = 20.0) -> dict[str, float]:
        """Every worker's free KV block count back at its total (the starting value)."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            free = {k: v for k, v in m.items() if k.startswith("tandem_kv_free_blocks")}
            total = {k.replace("free", "total"): v for k, v in free.items()}
            if free and all(m.get(k) == v for k, v in total.items()):
                return free
            if time.time() > deadline:
                raise AssertionError(f"KV blocks not returned: free={free} total={total}")
            time.sleep(0.3)

    def counter(self, name: str, role: str | None = None) -> float:
        """A per-worker counter summed over the workers (of one role)."""
        return sum(
            v
            for k, v in self.metrics().items()
            if k.startswith(name + "{") and (role is None or f'role="{role}"' in k)
        )

    def wait_counter(
        self, name: str, role: str | None, at_least: float, timeout: float = 20.0
    ) -> float:
        """Load reports reach /metrics a beat after the requests finish: poll until the
        counter reaches `at_least` (or the deadline), and return its value."""
        deadline = time.time() + timeout
        while True:
            value = self.counter(name, role)
            if value >= at_least or time.time() > deadline:
                return value
            time.sleep(0.3)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def leftovers(self, timeout: float = 15.0) -> list[str]:
        """Processes still alive in the serve process's session (Ray's raylet, GCS, actor
        workers, ... all inherit it): after a clean shutdown there must be none."""
        deadline = time.time() + timeout
        while True:
            ps = subprocess.run(
                ["ps", "-eo", "sid=,pid=,args="], capture_output=True, text=True, check=True
            ).stdout
            left = [
                line.strip()
                for line in ps.splitlines()
                if line.split(None, 1)[0] == str(self.proc.pid)
            ]
            if not left or time.time() > deadline:
                return left
            time.sleep(0.5)


@pytest.fixture(scope="session")
def e2e_model(make_tiny_model) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def start_serve(tmp_path_factory):
    """A context manager: `with start_serve(model, *flags) as server:`; on exit it sends
    SIGTERM and checks that tandem serve shut down cleanly (exit code 0)."""
    import contextlib

    @contextlib.contextmanager
    def start(model: Path, *args: str):
        sp = ServeProcess(model, tmp_path_factory.mktemp("serve"), *args)
        try:
            yield sp
        finally:
            code = sp.stop()
        assert code == 0, f"tandem serve exited with {code}:\n{sp.log_path.read_text()[-3000:]}"
        assert sp.leftovers() == [], "tandem serve left processes behind"

    return start
