"""Bad requests get an OpenAI-style 4xx (never a 5xx) and the router stays healthy."""

from __future__ import annotations

import asyncio
import copy
import json

import aiohttp
import pytest

from router.server import ModelInfo

CTX = 1024  # the tiny llama's max_position_embeddings
VOCAB = 1024


async def post_many(url: str, cases: list[tuple[str, bytes]], headers=None):
    out = []
    async with aiohttp.ClientSession() as s:
        for path, data in cases:
            h = {"Content-Type": "application/json", **(headers or {})}
            async with s.post(url + path, data=data, headers=h) as r:
                out.append((r.status, await r.text()))
        async with s.get(url + "/health") as r:
            out.append((r.status, await r.text()))
    return out


def check_error(status: int, text: str, expect_status: int, needle: str = "") -> dict:
    assert status == expect_status, (status, text)
    body = json.loads(text)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert needle.lower() in err["message"].lower(), (needle, err["message"])
    return err


C, CH = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def j(obj) -> bytes:
    return json.dumps(obj).encode()


CASES = [
    # (path, body, status, substring of the message, param)
    (C, b"{not json", 400, "not valid JSON", None),
    (C, b"\xff\xfe", 400, "not valid JSON", None),
    (C, b"[" * 20000 + b"]" * 20000, 400, "not valid JSON", None),
    (C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", "temperature"),
    (C, j({"prompt": "hi", "seed": 10**30}), 400, "seed", "seed"),
    (C, j({"prompt": [5, {"a": 1}]}), 400, "integers", "prompt"),
    (C, j([1, 2]), 400, "JSON object", None),
    (C, j("prompt"), 400, "JSON object", None),
    (C, j({"max_tokens": 3}), 400, "prompt", "prompt"),
    (CH, j({"max_tokens": 3}), 400, "messages", "messages"),
    (C, j({"prompt": 123}), 400, "prompt must be", "prompt"),
    (C, j({"prompt": "hi", "max_tokens": "5"}), 400, "integer", "max_tokens"),
    (C, j({"prompt": "hi", "max_tokens": 2.5}), 400, "integer", "max_tokens"),
    (C, j({"prompt": "hi", "temperature": "hot"}), 400, "temperature", "temperature"),
    (C, j({"prompt": "hi", "stream": "yes"}), 400, "stream", "stream"),
    (C, j({"prompt": "hi", "stop": 5}), 400, "stop", "stop"),
    (C, j({"prompt": "hi", "stop": ["a", ""]}), 400, "stop", "stop"),
    (C, j({"prompt": "hi", "seed": "x"}), 400, "seed", "seed"),
    (C, j({"prompt": "hi", "ignore_eos": "no"}), 400, "ignore_eos", "ignore_eos"),
    (C, j({"prompt": "hi", "stop_token_ids": [VOCAB]}), 400, "vocabulary", "stop_token_ids"),
    (CH, j({"messages": "hi"}), 400, "messages", "messages"),
    (CH, j({"messages": [{"role": "user", "content": 5}]}), 400, "content", "messages"),
    (CH, j({"messages": ["hi"]}), 400, "object", "messages"),
    (C, j({"prompt": "hi", "max_tokens": -1}), 400, "at least 1", "max_tokens"),
    (C, j({"prompt": "hi", "max_tokens": 0}), 400, "at least 1", "max_tokens"),
    (C, j({"prompt": "hi", "max_tokens": 10**6}), 400, f"{CTX} tokens", "max_tokens"),
    (C, j({"prompt": [5] * 1000, "max_tokens": 100}), 400, f"{CTX} tokens", "max_tokens"),
    (CH, j({"messages": USER, "max_completion_tokens": CTX}), 400, f"{CTX}", None),
    (C, j({"prompt": [7] * (CTX + 5)}), 400, f"{CTX} tokens", "prompt"),
    (C, j({"prompt": "hello " * 2000}), 400, f"{CTX} tokens", "prompt"),
    (C, j({"prompt": "x" * 60000}), 400, "characters", "prompt"),  # refused untokenized
    (CH, j({"messages": [{"role": "user", "content": "y" * 60000}]}), 400, f"{CTX}", None),
    (C, j({"prompt": [5, VOCAB]}), 400, "outside the vocabulary", "prompt"),
    (C, j({"prompt": [5, -1]}), 400, "outside the vocabulary", "prompt"),
    (C, j({"prompt": [5, True]}), 400, "integers", "prompt"),
    (C, j({"prompt": [5, 1.5]}), 400, "integers", "prompt"),
    (C, j({"prompt": "hi", "temperature": -0.1}), 400, "temperature", "temperature"),
    (C, j({"prompt": "hi", "top_p": 0}), 400, "top_p", "top_p"),
    (C, j({"prompt": "hi", "top_p": 1.5}), 400, "top_p", "top_p"),
    (C, j({"prompt": "hi", "top_k": -5}), 400, "top_k", "top_k"),
    (C, j({"prompt": ""}), 400, "empty", "prompt"),
    (C, j({"prompt": []}), 400, "empty", "prompt"),
    (C, j({"prompt": [[]]}), 400, "empty", "prompt"),
    (CH, j({"messages": []}), 400, "empty", "messages"),
    (C, j({"prompt": ["a", 5]}), 400, "integers", "prompt"),
    (C, j({"model": "gpt-4", "prompt": "hi"}), 404, "gpt-4", "model"),
    (CH, j({"model": "gpt-4", "messages": USER}), 404, "does not exist", "model"),
    (C, j({"model": 5, "prompt": "hi"}), 400, "model", "model"),
    (CH, j({"messages": [{"role": "wizard", "content": "x"}]}), 400, "wizard", "messages"),
    (CH, j({"messages": [{"content": "x"}]}), 400, "role", "messages"),
    (C, j({"prompt": "hi", "n": 0}), 400, "'n'", "n"),
    (C, j({"prompt": "hi", "n": 500}), 400, "'n'", "n"),
    (C, j({"prompt": "hi", "n": 2, "best_of": 1}), 400, "best_of", "best_of"),
    (C, j({"prompt": "hi", "stream_options": {"include_usage": True}}), 400, "stream", None),
    (C, j({"prompt": "hi", "echo": "yes"}), 400, "echo", "echo"),
    (C, j({"prompt": "hi", "logprobs": 21}), 400, "logprobs", "logprobs"),
    (C, j({"prompt": "hi", "presence_penalty": 3}), 400, "presence_penalty", "presence_penalty"),
    (C, j({"prompt": "hi", "repetition_penalty": 0}), 400, "repetition_penalty", None),
    (C, j({"prompt": "hi", "logit_bias": {str(VOCAB): 1}}), 400, "vocabulary", "logit_bias"),
    (C, j({"prompt": "hi", "logit_bias": {"5": 101}}), 400, "logit_bias", "logit_bias"),
    (C, j({"prompt": "hi", "min_p": 2}), 400, "min_p", "min_p"),
    (C, j({"prompt": "hi", "min_tokens": -1}), 400, "min_tokens", "min_tokens"),
    (C, j({"prompt": "hi", "suffix": "x"}), 400, "suffix", "suffix"),
    (CH, j({"messages": USER, "top_logprobs": 2}), 400, "logprobs", "top_logprobs"),
    (CH, j({"messages": USER, "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs", None),
    (CH, j({"messages": USER, "functions": [{"name": "f"}]}), 400, "tools", "functions"),
    (CH, j({"messages": USER, "tool_choice": "required"}), 400, "tools", "tool_choice"),
    (CH, j({"messages": USER, "response_format": {"type": "xml"}}), 400, "xml", None),
    (CH, j({"messages": [{"role": "user", "content": "x", "audio": 1}]}), 400, "audio", None),
    (CH, j({"messages": USER, "guided_regex": "a", "guided_choice": ["b"]}), 400, "one", None),
    (C, j({"prompt": "hi", "allowed_token_ids": []}), 400, "at least 1", "allowed_token_ids"),
    (C, j({"prompt": "hi", "allowed_token_ids": [3, VOCAB]}), 400, "vocab", "allowed_token_ids"),
    (C, j({"prompt": "hi", "bad_words": [" \t"]}), 400, "white space", "bad_words"),
    (C, j({"prompt": "hi", "bad_words": ["x y " * 300]}), 400, "over 256", "bad_words"),
    (C, j({"prompt": "hi", "bad_words": ["ok"] * 513}), 400, "512", "bad_words"),
    (C, j({"prompt": "hi", "truncate_prompt_tokens": 0}), 400, "-1 or", "truncate_prompt_tokens"),
    (CH, j({"messages": USER, "truncate_prompt_tokens": CTX + 1}), 400, "window", None),
    (C, j({"prompt": "hi", "priority": 1}), 400, "first served", "priority"),
    (CH, j({"messages": USER, "priority": -1}), 400, "first served", "priority"),
    (CH, j({"messages": USER, "use_beam_search": True}), 400, "beam", "use_beam_search"),
    (C, j({"prompt": "hi", "cache_salt": ""}), 400, "empty", "cache_salt"),
    (C, j({"prompt": "hi", "cache_salt": "s" * 1025}), 400, "at most 1024", "cache_salt"),
    (CH, j({"messages": USER, "cache_salt": 5}), 400, "string", "cache_salt"),
    (CH, j({"messages": USER, "documents": [{"text": 1}]}), 400, "string", "documents"),
    (C, b"x" * (64 * 1024 + 1), 413, "limit", None),
]


def test_bad_requests_are_4xx_and_server_stays_healthy(make_router):
    h = make_router(max_body_bytes=64 * 1024)
    results = asyncio.run(post_many(h.base_url, [(p, b) for p, b, *_ in CASES]))
    for (_path, body, status, needle, param), (got, text) in zip(CASES, results, strict=False):
        err = check_error(got, text, status, needle)
        if param is not None:
            assert err["param"] == param, (body[:80], err)
    assert results[-1][0] == 200  # /health
    # No request reached a worker, and each was counted as a client error.
    assert h.workers[0].received == []
    text = asyncio.run(_get_text(h.base_url + "/metrics"))
    assert f'tandem_requests_total{{status="client_error"}} {float(len(CASES))}' in text


async def _get_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def test_unknown_route_and_method(make_router):
    h = make_router()

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(h.base_url + "/v1/nothing") as r:
                a = (r.status, await r.text())
            async with s.get(h.base_url + "/v1/completions") as r:
                b = (r.status, await r.text())
        return a, b

    (s1, t1), (s2, t2) = asyncio.run(go())
    check_error(s1, t1, 404)
    check_error(s2, t2, 405)


def test_openai_client_sees_bad_request(make_router):
    import openai

    h = make_router()
    client = h.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=CTX)
    assert str(CTX) in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)
    assert client.completions.create(model="tiny-llama", prompt="hi", max_tokens=1).choices


def test_defaults_for_max_tokens(make_router, model_info):
    h = make_router()
    client = h.openai()
    res = client.completions.create(model="tiny-llama", prompt="hi")
    assert res.usage.completion_tokens == 16  # completions default
    res = client.chat.completions.create(model="tiny-llama", messages=USER)
    # Chat default: the whole room left in the context window.
    assert res.usage.completion_tokens == CTX - res.usage.prompt_tokens
    res = client.completions.create(model="tiny-llama", prompt=[5] * (CTX - 3))
    assert res.usage.completion_tokens == 3  # default capped by the window


def test_chat_without_template_is_400(make_router, model_info):
    tok = copy.deepcopy(model_info.tokenizer)
    tok.chat_template = None
    h = make_router(info=ModelInfo(tok, model_info.max_model_len, model_info.vocab_size))
    results = asyncio.run(post_many(h.base_url, [(CH, j({"messages": USER}))]))
    err = check_error(*results[0], 400, "no chat template")
    assert err["code"] == "no_chat_template"
    assert results[-1][0] == 200
