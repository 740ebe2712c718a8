"""A live `tandem serve` in its own process session, for fault injection, soak and fuzzing.

Lifecycle: `start()` runs `tandem serve` (local Ray, real actors, NIXL, ZMQ, HTTP) as a
subprocess in a new session and returns once its ready file appears; the serve log names every
worker's pid (and the controller logs each replacement's), so `pid(name)` / `kill(name, sig)`
reach the current process of a worker, the controller or the router. `stop()` sends SIGTERM
(tandem serve drains, then exits 0) and reports the exit code; `leftovers()` lists processes of
the session still alive after it. Reading /metrics gives the workers' KV block counts, so a
run can prove every block came back (`wait_blocks_free`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

_WORKER_LINE = re.compile(r"tandem:\s+(\S+)\s+\S+\s+requests (\S+)\s+kv (\S+).*pid (\d+)")
_RESTART_LINE = re.compile(r"worker (\S+) restarted: .* pid (\d+)")
_METRIC_LINE = re.compile(r"^(tandem_[a-z_]+(?:\{[^}]*\})?) ([-0-9.e+]+)$")


class LiveServer:
    def __init__(self, model: Path | str, workdir: Path, *flags: str, router_only: bool = False):
        self.model = str(model)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.flags = list(flags)
        self.router_only = router_only
        self.ready_file = self.workdir / "ready.json"
        self.log_path = self.workdir / "serve.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout_s: float = 180.0) -> LiveServer:
        self.ready_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "cluster.cli", "serve", "--model", self.model]
        cmd += ["--port", "0", "--ready-file", str(self.ready_file), *self.flags]
        if not self.router_only and "--num-cpus" not in self.flags:
            cmd += ["--num-cpus", "2"]  # a worker per core on the 2-core box, by default
        log = open(self.log_path, "a")
        repo = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(
            cmd, cwd=repo, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tandem serve did not start:\n{self.log_text()[-4000:]}")
            time.sleep(0.3)
        self.url = json.loads(self.ready_file.read_text())["url"]
        return self

    # -- processes ---------------------------------------------------------------------------
    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def pids(self) -> dict[str, int]:
        """Current pid of every worker (by id), "controller", and "router" (tandem serve)."""
        text = self.log_text()
        out = {m.group(1): int(m.group(4)) for m in _WORKER_LINE.finditer(text)}
        out.update({m.group(1): int(m.group(2)) for m in _RESTART_LINE.finditer(text)})
        controller = re.findall(r"tandem: controller pid (\d+)", text)
        if controller:
            out["controller"] = int(controller[-1])
        if self.proc is not None:
            out["router"] = self.proc.pid
        return out

    def endpoints(self) -> dict[str, tuple[str, str]]:
        """Worker id -> (request endpoint, KV side-channel endpoint), as first started."""
        text = self.log_text()
        return {m.group(1): (m.group(2), m.group(3)) for m in _WORKER_LINE.finditer(text)}

    def ray_address(self) -> str:
        found = re.findall(r"tandem: ray (\S+)", self.log_text())
        if not found:
            raise RuntimeError("the serve log names no Ray address")
        return found[-1]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        pid = self.pids()[name]
        os.kill(pid, sig)
        return pid

    def stop(self, timeout_s: float = 90.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    def leftovers(self, timeout_s: float = 15.0) -> list[str]:
        """Processes still alive in the serve process's session."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            ps = subprocess.run(
                ["ps", "-eo", "sid=,pid=,args="], capture_output=True, text=True, check=True
            ).stdout
            left = [
                line.strip()
                for line in ps.splitlines()
                if line.split(None, 1)[0] == str(self.proc.pid)
            ]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    # -- HTTP --------------------------------------------------------------------------------
    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: dict, timeout_s: float = 60.0) -> tuple[int, dict]:
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        """Seconds until /ready answers 200 (raises at the timeout)."""
        t0 = time.monotonic()
        while self.get("/ready")[0] != 200:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"not ready after {timeout_s}s")
            time.sleep(0.1)
        return time.monotonic() - t0

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics")[1])

    def kv_blocks(self) -> dict[str, tuple[float, float]]:
        """Worker id -> (free, total) KV blocks, from the workers' latest load reports."""
        return kv_block_counts(self.metrics())

    def wait_blocks_free(self, timeout_s: float = 30.0) -> int:
        """Blocks not back (total - free, summed over workers) once all are back or at the
        timeout; 0 means nothing leaked."""
        deadline = time.monotonic() + timeout_s
        while True:
            blocks = self.kv_blocks()
            leaked = int(sum(total - free for free, total in blocks.values()))
            if (blocks and leaked == 0) or time.monotonic() > deadline:
                return leaked if blocks else -1
            time.sleep(0.3)


def parse_metrics(text: str) -> dict[str, float]:
    """tandem's samples of a Prometheus text page: `name{labels}` -> value."""
    out = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def kv_block_counts(metrics: dict[str, float]) -> dict[str, tuple[float, float]]:
    """Worker id -> (free, total) KV blocks, from parsed /metrics."""
    out: dict[str, list[float]] = {}
    for key, value in metrics.items():
        m = re.match(r'tandem_kv_(free|total)_blocks\{.*worker="([^"]+)"', key)
        if m:
            out.setdefault(m.group(2), [0.0, 0.0])[m.group(1) == "total"] = value
    return {w: (v[0], v[1]) for w, v in out.items()}
