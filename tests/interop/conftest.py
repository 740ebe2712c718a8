"""A live `tandem serve` for the package (the e2e `ServeProcess`), its OpenAI client, and the
transformers reference on the same weights."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from e2e.conftest import start_serve  # noqa: F401 - the fixture, shared with tests/e2e

from .reference import Reference

# Prompts shorter than this many tokens are prefilled on the decode worker; longer ones take
# the prefill worker and the KV hand-off. The tests use both.
THRESHOLD = 24
# What tests/e2e/test_serve_parity.py runs for exact fp32 parity with transformers.
SERVE_FLAGS = (
    "--dtype", "float32", "--prefill", "1", "--decode", "1",
    "--disagg-threshold", str(THRESHOLD), "--max-num-batched-tokens", "256",
)  # fmt: skip


@pytest.fixture(scope="session")
def interop_model(make_tiny_model) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def reference(interop_model) -> Reference:
    return Reference.from_dir(interop_model)


@pytest.fixture(scope="package")
def server(interop_model, start_serve):  # noqa: F811 - the imported fixture
    """One `tandem serve` for the package's modules (started once: a start is ~15 s of the
    suite); it must shut down cleanly (exit 0, nothing left). test_real_model.py has its own."""
    with start_serve(interop_model, *SERVE_FLAGS) as sp:
        yield sp


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model_name(client) -> str:
    """The served model name, as a client finds it (the e2e tests do the same)."""
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def chat(client, model_name):
    """`client.chat.completions.create` for the served model."""

    def create(**kwargs):
        return client.chat.completions.create(model=model_name, **kwargs)

    return create
