"""Fixtures that run the real `tandem serve` (local Ray, real actors, NIXL, ZMQ, HTTP) as a
subprocess (bench.live_server.LiveServer), and helpers to read its Prometheus metrics."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.live_server import LiveServer

REPO = Path(__file__).resolve().parents[2]


class ServeProcess(LiveServer):
    """A started `tandem serve` (bench.live_server.LiveServer) plus the counters e2e tests
    read from its /metrics."""

    def __init__(self, model: Path, tmp: Path, *args: str):
        super().__init__(model, tmp, *args)
        self.start()

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
