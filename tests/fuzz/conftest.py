"""A live `tandem serve` per fuzz module (the e2e `start_serve` fixture: real Ray actors, ZMQ,
NIXL, HTTP), the router's OpenAPI document, and a request parser built the way the router
builds its own. The HTTP and the frame fuzzing get a server each, so that a frame that breaks
a worker cannot fail the HTTP tests too."""

from __future__ import annotations

import pytest
from e2e.conftest import start_serve  # noqa: F401 - the fixture, shared with tests/e2e

from router.openapi import openapi_document

SERVED = "fuzz-model"
BODY_LIMIT = 1 << 20  # --max-body-bytes: small, so bodies around it are cheap to send
FRAME_LIMIT = 1 << 20  # --max-frame-mb 1: worker and side-channel frames over it are dropped
# 1 prefill + 1 decode worker; prompts of 8+ tokens take the KV hand-off, shorter ones do not.
SERVE_FLAGS = (
    "--dtype", "float32", "--served-model-name", SERVED, "--disagg-threshold", "8",
    "--max-frame-mb", "1", "--max-body-bytes", str(BODY_LIMIT), "--body-timeout-s", "3",
)  # fmt: skip


@pytest.fixture(scope="session")
def fuzz_model(make_tiny_model):
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def server(fuzz_model, start_serve):  # noqa: F811 - the imported fixture
    """Shared by a module's tests; it must still shut down cleanly (exit 0, nothing left)."""
    with start_serve(fuzz_model, *SERVE_FLAGS) as sp:
        yield sp


@pytest.fixture(scope="session")
def doc() -> dict:
    return openapi_document(SERVED)


@pytest.fixture(scope="session")
def parser(fuzz_model):
    """A RequestParser as RouterServer._start builds it (structured-output checks included)."""
    from router.config import RouterConfig
    from router.openai_api import RequestParser
    from router.server import RouterServer, load_model_info
    from router.tools import detect_tool_format

    config = RouterConfig(model_path=str(fuzz_model), served_model_name=SERVED)
    info = load_model_info(config)
    return RequestParser(
        info.tokenizer,
        SERVED,
        info.max_model_len,
        info.vocab_size,
        config.completion_default_max_tokens,
        generation_defaults=info.generation_defaults,
        check_structured=RouterServer._structured_checker(info),
        tool_format=detect_tool_format(getattr(info.tokenizer, "chat_template", None)),
    )
