"""A live `tandem serve` per fuzz module (the e2e `start_serve` fixture: real Ray actors, ZMQ,
NIXL, HTTP), the router's OpenAPI document, and a request parser built the way the router
builds its own. The HTTP and the frame fuzzing get a server each, so that a frame that breaks
a worker cannot fail the HTTP tests too."""

from __future__ import annotations

import pytest
from e2e.conftest import start_serve  # noqa: F401 - the fixture, shared with tests/e2e
from hypothesis import HealthCheck, Phase, settings

from router.openapi import openapi_document

SERVED = "fuzz-model"
BODY_LIMIT = 1 << 20  # --max-body-bytes: small, so bodies around it are cheap to send
FRAME_LIMIT = 1 << 20  # --max-frame-mb 1: worker and side-channel frames over it are dropped
# 1 prefill + 1 decode worker; prompts of 8+ tokens take the KV hand-off, shorter ones do not.
SERVE_FLAGS = (
    "--dtype", "float32", "--served-model-name", SERVED, "--disagg-threshold", "8",
    "--max-frame-mb", "1", "--max-body-bytes", str(BODY_LIMIT), "--body-timeout-s", "3",
)  # fmt: skip


# For a live, stateful target: no shrinking (a frame that kills a thread fails every later one,
# and shrinking against a server is slow), so a failure is reported as drawn; test_edge_case and
# the frame tests' explicit examples hold a minimal input of every kind found so far.
LIVE_SETTINGS = settings(
    phases=(Phase.explicit, Phase.generate),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="session")
def fuzz_model(make_tiny_model):
    return make_tiny_model("llama")


@pytest.fixture(scope="package")
def server(fuzz_model, start_serve):  # noqa: F811 - the imported fixture
    """Shared by the package's modules (frames, then HTTP: the HTTP fuzz also proves the
    frame fuzz left the server whole); it must still shut down cleanly (exit 0, nothing
    left)."""
    with start_serve(fuzz_model, *SERVE_FLAGS) as sp:
        yield sp


@pytest.fixture(scope="session")
def doc() -> dict:
    return openapi_document(SERVED)


@pytest.fixture(scope="session")
def parser(fuzz_model):
    """The RequestParser RouterServer builds (structured-output checks included)."""
    from router.config import RouterConfig
    from router.server import load_model_info, request_parser

    config = RouterConfig(model_path=str(fuzz_model), served_model_name=SERVED)
    return request_parser(config, load_model_info(config))
