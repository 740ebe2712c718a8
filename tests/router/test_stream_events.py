"""The streamed chunks' fast path (router.serving.StreamWriter.events, responses.TextEvents)
writes exactly the bytes of `sse_event(chunk)` for every piece, whatever the request asked."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from engine.protocol import SamplingParams
from router import responses
from router.generation import Piece
from router.openai_api import ParsedRequest
from router.serving import StreamWriter

TEXTS = ["", "Hello", " world", 'quote " back\\slash', "é ü 日本 \u2028 \x00 \x1f", "😀", "</s>\n"]
FINISHES = [None, "stop", "length"]


def _run(parsed: ParsedRequest, rid: str) -> SimpleNamespace:
    return SimpleNamespace(parsed=parsed, rid=rid, tokenizer=None, text_of=None)


@pytest.mark.parametrize(
    "kind,include_usage,n,prompts,model,rid",
    list(
        itertools.product(
            ["chat", "completion"],
            [False, True],
            [1, 3],
            [1, 2],
            ["m", 'mödel "x"'],
            ["chatcmpl-abc", "cmpl-\u00e9"],
        )
    ),
)
def test_plain_events_equal_the_chunks(kind, include_usage, n, prompts, model, rid):
    parsed = ParsedRequest(
        kind=kind,
        model=model,
        prompt_ids=[1, 2],
        sampling=SamplingParams(max_tokens=8, n=n),
        stream=True,
        include_usage=include_usage,
        prompts=[[1, 2]] * prompts,
        n=n,
    )
    fast = StreamWriter(_run(parsed, rid), 1_700_000_000)
    slow = StreamWriter(_run(parsed, rid), 1_700_000_000)
    assert fast._plain
    assert fast.role_events() == [responses.sse_event(c) for c in slow.role_chunks()]
    for p, choice, text, finish in itertools.product(range(prompts), range(n), TEXTS, FINISHES):
        piece = Piece(text, 1, finish, choice, [5])
        want = [responses.sse_event(c) for c in slow.chunks(p, piece)]
        assert fast.events(p, piece) == want


def test_requests_with_extras_take_the_chunk_path():
    base = dict(kind="chat", model="m", prompt_ids=[1], sampling=SamplingParams(max_tokens=4))
    for extra in (
        dict(logprobs=2),
        dict(tools=[{"type": "function"}], tool_choice="auto"),
        dict(extra={"echo_text": "hi"}),
        dict(kind="completion", echo=True),
    ):
        parsed = ParsedRequest(**{**base, **extra})
        assert not StreamWriter(_run(parsed, "r"), 1)._plain
