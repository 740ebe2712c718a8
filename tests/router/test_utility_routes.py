"""/tokenize, /detokenize and /version on a bare aiohttp app with the tiny model's real
tokenizer: round trips, counts, the chat form, and every client mistake as an OpenAI error."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.errors import APIError, bad_request
from router.utility_routes import add_utility_routes

SERVED = "tiny-llama"
MAX_LEN = 777
VERSION = "0.9.1-test"
TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café ✓ 日本",
    " a\n\tb ",
]


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    # The server's error middleware, reduced to what these routes rely on.
    try:
        return await handler(request)
    except APIError as e:
        return e.response()


def _chat_parser(tokenizer):
    def parse(body: dict) -> list[int]:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages")
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=body["add_generation_prompt"]
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return parse


def _app(tokenizer, chat: bool = True) -> web.Application:
    app = web.Application(middlewares=[_errors])
    parser = _chat_parser(tokenizer) if chat else None
    add_utility_routes(app, tokenizer, SERVED, MAX_LEN, VERSION, parser)
    return app


def _run(app: web.Application, calls: list[tuple[str, str, object]]) -> list[tuple[int, object]]:
    """Each call is (method, path, body); str or bytes go out verbatim (bad JSON tests)."""

    async def go() -> list[tuple[int, object]]:
        out = []
        async with TestClient(TestServer(app)) as client:
            for method, path, body in calls:
                data = body if isinstance(body, str | bytes) else json.dumps(body)
                async with client.request(method, path, data=data) as r:
                    out.append((r.status, await r.json(content_type=None)))
        return out

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tok(model_info):
    return model_info.tokenizer


def _post(tok, path: str, body, chat: bool = True) -> tuple[int, object]:
    return _run(_app(tok, chat), [("POST", path, body)])[0]


def _error(reply: tuple[int, object], status: int, param: str | None = None) -> dict:
    code, body = reply
    assert code == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    return err


# ---------------------------------------------------------------------------- happy paths


def test_tokenize_detokenize_round_trip(tok):
    calls = []
    for text in TEXTS:
        calls.append(("POST", "/tokenize", {"prompt": text, "add_special_tokens": False}))
        calls.append(("POST", "/tokenize", {"model": SERVED, "prompt": text}))
    replies = _run(_app(tok), calls)
    for i, text in enumerate(TEXTS):
        (s1, plain), (s2, special) = replies[2 * i], replies[2 * i + 1]
        assert s1 == s2 == 200
        assert plain["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
        assert special["tokens"] == tok(text)["input_ids"]
        for r in (plain, special):
            assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_LEN
            assert "token_strs" not in r
    back = _run(_app(tok), [("POST", "/detokenize", {"tokens": r[1]["tokens"]}) for r in replies])
    for i, text in enumerate(TEXTS):
        assert back[2 * i] == (200, {"prompt": text})
        assert back[2 * i + 1] == (200, {"prompt": tok.decode(replies[2 * i + 1][1]["tokens"])})


def test_return_token_strs_and_empty_inputs(tok):
    text = TEXTS[1]
    (s, r), (s0, empty), (sd, nothing) = _run(
        _app(tok),
        [
            ("POST", "/tokenize", {"prompt": text, "return_token_strs": True}),
            ("POST", "/tokenize", {"prompt": "", "add_special_tokens": None}),
            ("POST", "/detokenize", {"tokens": [], "model": None}),
        ],
    )
    assert s == s0 == sd == 200
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]) and len(r["token_strs"]) > 3
    assert empty["tokens"] == tok("")["input_ids"] and empty["count"] == len(empty["tokens"])
    assert nothing == {"prompt": ""}


def test_detokenize_keeps_special_tokens(tok):
    ids = [tok.bos_token_id, *tok("hi there", add_special_tokens=False)["input_ids"]]
    ids.append(tok.eos_token_id)
    status, body = _post(tok, "/detokenize", {"tokens": ids})
    assert status == 200
    assert body["prompt"] == f"{tok.bos_token}hi there{tok.eos_token}"


def test_tokenize_messages(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    replies = _run(
        _app(tok),
        [
            ("POST", "/tokenize", {"messages": messages}),
            ("POST", "/tokenize", {"messages": messages, "add_generation_prompt": False}),
            ("POST", "/tokenize", {"messages": messages, "return_token_strs": True}),
        ],
    )
    (s1, gen), (s2, nogen), (s3, strs) = replies
    assert s1 == s2 == s3 == 200
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert gen["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert gen["count"] == len(gen["tokens"]) and gen["max_model_len"] == MAX_LEN
    # Without the generation prompt: the same turns, minus the assistant header.
    assert nogen["count"] < gen["count"] and gen["tokens"][: nogen["count"]] == nogen["tokens"]
    assert strs["token_strs"] == tok.convert_ids_to_tokens(gen["tokens"])


def test_version(tok):
    assert _run(_app(tok), [("GET", "/version", None)]) == [(200, {"version": VERSION})]


# ---------------------------------------------------------------------------- errors


def test_wrong_model_is_404_on_both_routes(tok):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        err = _error(_post(tok, path, {**body, "model": "gpt-4"}), 404, "model")
        assert err["code"] == "model_not_found" and "gpt-4" in err["message"]
        assert SERVED in err["message"]
        _error(_post(tok, path, {**body, "model": 7}), 400, "model")


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {"prompt": "x", "temperature": 0}, "temperature"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"messages": [], "add_special_tokens": True}, "add_special_tokens"),
        ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
    ],
)
def test_unknown_fields_are_named(tok, path, body, param):
    err = _error(_post(tok, path, body), 400, param)
    assert repr(param) in err["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "prompt"),
        ({"model": SERVED}, "prompt"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"prompt": ["x"]}, "prompt"),
        ({"prompt": [1, 2]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
        ({"messages": [], "add_generation_prompt": 0}, "add_generation_prompt"),
        ({"messages": "hi"}, "messages"),  # refused by the chat parser, passed through
    ],
)
def test_tokenize_bad_bodies(tok, body, param):
    _error(_post(tok, "/tokenize", body), 400, param)


def test_tokenize_messages_without_a_chat_template(tok):
    body = {"messages": [{"role": "user", "content": "x"}]}
    err = _error(_post(tok, "/tokenize", body, chat=False), 400, "messages")
    assert err["code"] == "no_chat_template"
    assert _post(tok, "/tokenize", {"prompt": "x"}, chat=False)[0] == 200


@pytest.mark.parametrize(
    "tokens,code",
    [
        (None, "missing_required"),
        ("1 2 3", None),
        ([1, "2"], None),
        ([1, 2.0], None),
        ([True], None),
        ([-1], "invalid_token_id"),
        ([5, 1024], "invalid_token_id"),
        ([2**70], "invalid_token_id"),
    ],
)
def test_detokenize_bad_tokens(tok, tokens, code):
    assert len(tok) == 1024  # the tiny tokenizer; 1024 is the first id outside it
    body = {} if tokens is None else {"tokens": tokens}
    err = _error(_post(tok, "/detokenize", body), 400, "tokens")
    assert err["code"] == code


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"text"', "null", b"\xff\xfe"])
def test_bodies_that_are_not_json_objects(tok, raw):
    for path in ("/tokenize", "/detokenize"):
        _error(_post(tok, path, raw), 400)
