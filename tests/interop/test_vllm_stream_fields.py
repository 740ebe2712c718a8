"""vLLM's request extensions that benchmark and agent clients send, against the package's live
`tandem serve` through the `openai` client: `stream_options.continuous_usage_stats` (guidellm
sends it on every stream), `structured_outputs.json_object`, a refused `structural_tag`, and
the keys inside request objects that nothing reads, named back by their path in
`X-Tandem-Ignored-Fields` (before, they were dropped without a word)."""

from __future__ import annotations

import json
from urllib.parse import unquote

import openai
import pytest

from .test_openai_chat import CONVERSATIONS, NO_EOS, USER

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def _ignored(raw) -> list[str]:
    header = raw.headers.get("X-Tandem-Ignored-Fields")
    return unquote(header).split(",") if header else []


@CONVERSATIONS
def test_continuous_usage_counts_each_choice_on_every_chunk(client, model_name, messages):
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=messages, n=2, max_tokens=6, temperature=1.0, seed=3,
        stream=True, stream_options=CONTINUOUS, extra_body=NO_EOS,
    )  # fmt: skip
    assert _ignored(raw) == []
    chunks = list(raw.parse())
    *per_token, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    prompt = last.usage.prompt_tokens
    seen = {0: 0, 1: 0}
    for chunk in per_token:
        (choice,) = chunk.choices
        usage = chunk.usage
        assert usage is not None, chunk  # every chunk, the role chunks too
        if choice.delta.role:  # the role chunk: nothing generated yet
            assert usage.completion_tokens == 0, chunk
        else:  # a piece holds one token or more (bytes of a character wait for the rest)
            assert usage.completion_tokens > seen[choice.index], chunk
        seen[choice.index] = usage.completion_tokens
        assert usage.prompt_tokens == prompt
        assert usage.total_tokens == prompt + usage.completion_tokens
    assert seen == {0: 6, 1: 6}


def test_continuous_usage_without_include_usage_is_named_and_sends_none(client, model_name):
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=USER, max_tokens=3, stream=True,
        stream_options={"continuous_usage_stats": True},
    )  # fmt: skip
    assert _ignored(raw) == ["stream_options.continuous_usage_stats"]
    assert all(chunk.usage is None for chunk in raw.parse())


def test_continuous_usage_on_completions_counts_per_prompt(client, model_name):
    prompts = ["Hello there", "The weather in Paris is sunny and warm today, said the man"]
    stream = client.completions.create(
        model=model_name, prompt=prompts, max_tokens=4, stream=True,
        stream_options=CONTINUOUS, extra_body=NO_EOS,
    )  # fmt: skip
    final: dict[int, tuple[int, int]] = {}
    for chunk in stream:
        if chunk.choices:
            final[chunk.choices[0].index] = (
                chunk.usage.prompt_tokens,
                chunk.usage.completion_tokens,
            )
    (p0, c0), (p1, c1) = final[0], final[1]
    assert p0 < p1 and c0 == c1 == 4  # each choice reports its own prompt's length


def test_structured_outputs_json_object_is_the_json_object_format(chat):
    """Greedy: the same tokens as response_format json_object (the same grammar), which the
    random model alone never writes (its first token is not '{')."""
    kwargs = dict(messages=USER, max_tokens=24, temperature=0)
    want = chat(**kwargs, response_format={"type": "json_object"}).choices[0].message.content
    got = chat(**kwargs, extra_body={"structured_outputs": {"json_object": True}})
    assert got.choices[0].message.content == want
    assert want.lstrip().startswith("{")
    free = chat(**kwargs).choices[0].message.content
    assert not free.lstrip().startswith("{"), free


def test_structural_tag_is_refused(chat):
    tag = {"type": "structural_tag", "structures": [], "triggers": []}
    with pytest.raises(openai.BadRequestError) as e:
        chat(messages=USER, max_tokens=2, extra_body={"structured_outputs": {
            "structural_tag": json.dumps(tag)}})  # fmt: skip
    body = e.value.body
    assert body["param"] == "structured_outputs" and "structural_tag" in body["message"]


def test_unread_nested_keys_are_named_by_path(client, model_name):
    messages = [
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "Weather in Paris?",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        }
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=messages, max_tokens=2, user="u-1",
        response_format={"type": "text", "verbosity": "low"},  # type: ignore[typeddict-unknown-key]
        extra_body={"structured_outputs": {"regex": "[a-z]{2}", "disable_any_whitespace": True}},
    )  # fmt: skip
    assert _ignored(raw) == [
        "messages[0].content[0].cache_control",
        "user",
        "response_format.verbosity",
        "structured_outputs.disable_any_whitespace",
    ]
    assert len(raw.parse().choices[0].message.content) == 2  # the regex still applies
