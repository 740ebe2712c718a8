"""The /v1/completions body: `CompletionRequest`, its `prompt` (a string, token ids, or a batch
of either, each checked against the vocabulary) and the rules only completions have (`echo`
with `max_tokens: 0`, `best_of`). The fields it shares with chat, and the validation order,
are router/protocol.py's `GenerationRequest`."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import ConfigDict, Field, PlainValidator, ValidationInfo, model_validator

from engine.protocol import MAX_N
from router.protocol import (
    Count,
    GenerationRequest,
    Logprobs,
    Text,
    fail,
    flag,
    refused,
    requires,
    vocab_of,
)


def _prompt(value: Any, info: ValidationInfo) -> list[str | list[int]]:
    """A string, token ids, or a batch of either -> the batch."""
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        if len(value) > MAX_N:
            raise fail(f"at most {MAX_N} prompts per request", whole=True)
        return [_one_prompt(p, info) for p in value]
    return [_one_prompt(value, info)]


def _one_prompt(prompt: Any, info: ValidationInfo) -> str | list[int]:
    if not isinstance(prompt, str | list):
        raise fail("prompt must be a string, a list of token ids, or a list of either", whole=True)
    if not prompt:
        raise fail("prompt must not be empty", "empty_prompt", whole=True)
    if isinstance(prompt, str):
        return prompt
    vocab = vocab_of(info)
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool):
            raise fail(f"prompt must contain only integers, got {t!r:.40}", whole=True)
        if not 0 <= t < vocab:
            message = f"token id {t} in prompt is outside the vocabulary [0, {vocab})"
            raise fail(message, "invalid_token_id", whole=True)
    return prompt


_PROMPT_SCHEMA = Union[  # noqa: UP007
    Text,
    Annotated[list[Count], Field(min_length=1)],
    Annotated[
        list[Text | Annotated[list[Count], Field(min_length=1)]],
        Field(min_length=1, max_length=MAX_N),
    ],
]
Prompt = Annotated[Any, PlainValidator(_prompt, json_schema_input_type=_PROMPT_SCHEMA)]


class CompletionRequest(GenerationRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                requires("stream_options", "stream"),
                {  # max_tokens 0 only with echo: the prompt alone, nothing generated
                    "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
                    "then": {"required": ["echo"], "properties": {"echo": {"const": True}}},
                },
            ]
        }
    )

    prompt: Prompt = Field(description="a string, token ids, or a batch of either")
    suffix: refused("suffix") = None
    max_tokens: Annotated[int, Field(json_schema_extra={"minimum": 0})] | None = flag(
        "tokens to generate; 0 only with echo: true"
    )
    logprobs: Logprobs | None = flag("top log-probabilities per generated token")
    echo: bool | None = flag("the prompt (and its logprobs) before the answer")
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = flag("answer the n most likely")

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionRequest:
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            message = f"'max_tokens' must be at least 1, got {self.max_tokens}"
            raise fail(message, whole=True, param="max_tokens")
        if self.best_of is not None and self.best_of < self.n:
            message = f"best_of ({self.best_of}) must be >= n ({self.n})"
            raise fail(message, whole=True, param="best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise fail("best_of > n cannot be streamed", whole=True, param="best_of")
        return self
