"""vLLM's `request_id` and `X-Request-Id`: the answer's id is `chatcmpl-<id>` (`cmpl-<id>` for
completions, every streamed chunk too), the header winning over the body; requests that choose
the same id run apart (each its own greedy answer, on both paths, at the same time), since the
id they run under stays the router's own. `logits_processors` (code the client names) is a 400,
as in vLLM without --logits-processor-pattern. Against the package's live `tandem serve`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from .test_openai_chat import USER

LONG = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "walked down to the harbour every morning before the sun came up"
)


def test_the_answer_id_is_the_chosen_one(client, model_name):
    chat = client.chat.completions.create(
        model=model_name, messages=USER, max_tokens=2, extra_body={"request_id": "trace-42"}
    )
    assert chat.id == "chatcmpl-trace-42"
    done = client.completions.create(
        model=model_name, prompt="hi", max_tokens=2, extra_body={"request_id": "trace-43"}
    )
    assert done.id == "cmpl-trace-43"
    fresh = client.completions.create(model=model_name, prompt="hi", max_tokens=2)
    assert fresh.id.startswith("cmpl-") and len(fresh.id) > len("cmpl-")


def test_every_streamed_chunk_and_the_header_carry_it(client, model_name):
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=USER, max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"request_id": "s-1"},
    )  # fmt: skip
    assert raw.headers["X-Request-Id"] == "chatcmpl-s-1"
    chunks = list(raw.parse())
    assert len(chunks) >= 3 and {c.id for c in chunks} == {"chatcmpl-s-1"}


def test_the_header_wins_over_the_body(client, model_name):
    answer = client.completions.create(
        model=model_name, prompt="hi", max_tokens=2, extra_body={"request_id": "body"},
        extra_headers={"X-Request-Id": "from-the-gateway"},
    )  # fmt: skip
    assert answer.id == "cmpl-from-the-gateway"
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=USER, max_tokens=2, extra_body={"request_id": "whole"}
    )
    assert raw.headers["X-Request-Id"] == raw.parse().id == "chatcmpl-whole"


def test_requests_choosing_one_id_run_apart(client, model_name, reference):
    """Six requests at once, all `request_id: same`, different prompts on both paths: each gets
    its own greedy answer (a shared run id would cross their tokens or refuse one)."""
    prompts = [f"{LONG} number {i}" if i % 2 else f"Day {i} of the week" for i in range(6)]

    def ask(prompt: str):
        return client.completions.with_raw_response.create(
            model=model_name, prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"request_id": "same", "ignore_eos": True},
        )  # fmt: skip

    with ThreadPoolExecutor(6) as pool:
        raws = list(pool.map(ask, prompts))
    assert {raw.headers["X-Tandem-Path"] for raw in raws} == {"local", "remote"}
    for prompt, raw in zip(prompts, raws, strict=True):
        answer = raw.parse()
        assert answer.id == "cmpl-same"
        assert answer.choices[0].text == reference.greedy_text(reference.encode(prompt), 6)


@pytest.mark.parametrize(
    ("fields", "headers", "param"),
    [
        ({"request_id": "has space"}, {}, "request_id"),
        ({"request_id": ""}, {}, "request_id"),
        ({"request_id": "x" * 257}, {}, "request_id"),
        ({}, {"X-Request-Id": "x" * 257}, "X-Request-Id"),
        ({"logits_processors": ["my.module.Processor"]}, {}, "logits_processors"),
    ],
    ids=["space", "empty", "long", "long-header", "logits-processors"],
)
def test_bad_ids_and_logits_processors_are_refused(client, model_name, fields, headers, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model_name, prompt="hi", max_tokens=2, extra_body=fields, extra_headers=headers
        )
    assert e.value.body["param"] == param
