"""Fixtures: a tiny model dir (tandem make-model), and a router running on its own event loop
thread so the synchronous `openai` client and raw aiohttp calls can drive it."""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

import pytest
from router_fakes import FakeWorker

from router.config import RouterConfig
from router.directory import StaticDirectory
from router.server import ModelInfo, RouterServer, load_model_info

SERVED = "tiny-llama"


@pytest.fixture(scope="session")
def model_dir(make_tiny_model) -> str:
    return str(make_tiny_model("llama", "tiny", 0))


@pytest.fixture(scope="session")
def model_info(model_dir) -> ModelInfo:
    return load_model_info(RouterConfig(model_path=model_dir))


class RouterHarness:
    """A RouterServer on a background loop, plus the fake workers it routes to."""

    def __init__(
        self, server: RouterServer, directory: StaticDirectory, workers: list[FakeWorker]
    ) -> None:
        self.server = server
        self.directory = directory
        self.workers = workers
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(server.start())

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def openai(self, api_key: str = "unused"):
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=20
        )

    def close(self) -> None:
        try:
            self.call(self.server.stop())
        except TimeoutError:
            self._report_hang()
            raise
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
            self.loop.close()
            for w in self.workers:
                w.close()

    def _report_hang(self) -> None:
        """A stop that timed out: where the loop thread is, and what its tasks wait on."""
        frame = sys._current_frames().get(self._thread.ident)
        print("router loop thread stack:\n" + "".join(traceback.format_stack(frame)))
        for task in asyncio.all_tasks(self.loop):
            print(
                f"task {task.get_name()}:",
                "".join(traceback.format_stack(task.get_stack()[-1]))
                if task.get_stack()
                else "(no frame)",
            )


@pytest.fixture
def make_router(model_dir, model_info) -> Iterator[Callable[..., RouterHarness]]:
    made: list[RouterHarness] = []

    def make(
        workers: list[FakeWorker] | None = None, info: ModelInfo | None = None, **overrides
    ) -> RouterHarness:
        workers = workers if workers is not None else [FakeWorker("d0", "colocated")]
        cfg = dict(  # noqa: C408
            model_path=model_dir,
            served_model_name=SERVED,
            port=0,
            token_gap_timeout_s=2.0,
            request_timeout_s=20.0,
            refresh_interval_s=0.2,
        )
        cfg.update(overrides)
        directory = StaticDirectory([w.info() for w in workers])
        server = RouterServer(RouterConfig(**cfg), directory, model_info=info or model_info)
        h = RouterHarness(server, directory, workers)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
