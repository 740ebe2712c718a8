"""Property-based HTTP fuzzing of a live `tandem serve` (1 prefill + 1 decode worker).

Requests are drawn from the router's OpenAPI document (router/openapi.py, imported, so they
work whether or not /openapi.json is served) and from hostile variations of them
(tests/fuzz/hostile.py). Every answer must keep `live.Checker`'s invariants: no 5xx, no
dropped connection, errors as OpenAI error objects, 200s as documented. A body valid by the
document must be answered 200, or 400 naming a field whose rule the document lists under
x-tandem-checks. After each test /health is 200, a plain completion generates its tokens and
every worker's KV blocks are free again.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.parse

import pytest
from hypothesis import given, settings

from router.openapi import openapi_document

from .conftest import BODY_LIMIT, SERVED
from .conftest import LIVE_SETTINGS as FUZZ_SETTINGS
from .hostile import (
    LIVE_LIMITS,
    path_requests,
    raw_body_requests,
    valid_requests,
    wrong_field_requests,
)
from .live import Checker, Request, json_request, send, still_serving
from .schema_gen import SchemaGen


@pytest.fixture(scope="module")
def gen(doc) -> SchemaGen:
    return SchemaGen(doc, LIVE_LIMITS)


@pytest.fixture(scope="module")
def checker(doc) -> Checker:
    return Checker(doc)


def _after(server) -> None:
    assert still_serving(server.url, SERVED) == []
    server.wait_all_blocks_free(timeout=30)


def _assert_fine(checker: Checker, server, req: Request) -> dict | None:
    ans = send(server.url, req)
    problems = checker.problems(req, ans)
    assert problems == [], f"{req.short()}\n-> {problems}"
    if ans.status >= 400 and req.method != "HEAD":
        return json.loads(ans.body).get("error")
    return None


def test_bodies_valid_by_the_document(server, gen, checker, doc):
    checks = {p: op.get("post", {}).get("x-tandem-checks", {}) for p, op in doc["paths"].items()}

    @settings(FUZZ_SETTINGS, max_examples=70)
    @given(req=valid_requests(gen))
    def run(req):
        error = _assert_fine(checker, server, req)
        if error is not None:
            assert error["param"] in checks[req.path], (req.short(), error)

    run()
    _after(server)


def test_one_hostile_field(server, gen, checker):
    @settings(FUZZ_SETTINGS, max_examples=70)
    @given(req=wrong_field_requests(gen))
    def run(req):
        _assert_fine(checker, server, req)

    run()
    _after(server)


def test_damaged_bytes_and_content_types(server, gen, checker):
    @settings(FUZZ_SETTINGS, max_examples=50)
    @given(req=raw_body_requests(gen))
    def run(req):
        _assert_fine(checker, server, req)

    run()
    _after(server)


def test_paths_and_methods(server, checker):
    @settings(FUZZ_SETTINGS, max_examples=30)
    @given(req=path_requests())
    def run(req):
        _assert_fine(checker, server, req)

    run()
    _after(server)


# Each names one hostile input; the ids say what it is.
_EDGE_CASES = {
    "nested-1e5": ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    "nested-1e5-in-field": (
        "/v1/completions",
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ),
    "int-5000-digits": ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
    "nan": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}'),
    "infinity": ("/v1/chat/completions", b'{"messages": [], "top_p": -Infinity}'),
    "minus-zero": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": -0}'),
    "2**64": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 18446744073709551616}'),
    "1e308": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "top_k": 1e308}'),
    "surrogate-prompt": ("/v1/completions", b'{"prompt": "a \\ud800 b", "max_tokens": 2}'),
    "surrogate-message": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
    ),
    "surrogate-tokenize": ("/tokenize", b'{"prompt": "\\ud83d"}'),
    "surrogate-tool-description": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": '
        b'[{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]}',
    ),
    "crlf-in-unknown-field": (
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 2, "a\\r\\nb": 1}',
    ),
    "nul-in-unknown-field": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "\\u0000": 1}'),
    "nul-in-prompt": ("/v1/completions", b'{"prompt": "a\\u0000b", "max_tokens": 2}'),
    "raw-nul-byte": ("/v1/completions", b'{"prompt": "a\x00b", "max_tokens": 2}'),
    "invalid-utf8": ("/v1/completions", b'{"prompt": "a\xff\xfeb", "max_tokens": 2}'),
    "deep-json-text-in-guided-json": (
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 2, "guided_json": "' + b"[" * 10_000 + b'"}',
    ),
    "huge-int-text-in-guided-json": (
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 2, "guided_json": "' + b"1" * 5000 + b'"}',
    ),
    "deep-json-text-in-tool-arguments": (
        "/v1/chat/completions",
        b'{"max_tokens": 2, "messages": [{"role": "assistant", "tool_calls": [{"function": '
        b'{"name": "f", "arguments": "' + b"[" * 10_000 + b'"}}]}]}',
    ),
    "duplicate-keys": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "max_tokens": -1}'),
    "empty": ("/v1/completions", b""),
    "non-object": ("/v1/chat/completions", b'"just a string"'),
    "prompt-200k-ids": ("/v1/completions", json.dumps({"prompt": [5] * 200_000}).encode()),
    "stop-50k": (
        "/v1/completions",
        json.dumps(
            {"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(50_000)]}
        ).encode(),
    ),
    "messages-20k": (
        "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": "x"}] * 20_000, "max_tokens": 2}
        ).encode(),
    ),
    "logit-bias-301": (
        "/v1/completions",
        json.dumps({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}).encode(),
    ),
}


@pytest.mark.parametrize("case", sorted(_EDGE_CASES))
def test_edge_case(server, checker, case):
    path, body = _EDGE_CASES[case]
    _assert_fine(checker, server, Request("POST", path, body))
    assert still_serving(server.url, SERVED) == []


def _padded(size: int) -> bytes:
    """A completion body of exactly `size` bytes (its prompt far over the window)."""
    head, tail = b'{"prompt": "', b'", "max_tokens": 2}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


@pytest.mark.parametrize("size", [BODY_LIMIT - 1, BODY_LIMIT, BODY_LIMIT + 1, 4 * BODY_LIMIT])
def test_body_size_limit(server, checker, size):
    req = Request("POST", "/v1/completions", _padded(size))
    ans = send(server.url, req)
    assert checker.problems(req, ans) == []
    if size > BODY_LIMIT:
        assert ans.status == 413, ans.body[:200]
    else:  # read whole, then refused for its length without being tokenized
        assert ans.status == 400 and json.loads(ans.body)["error"]["param"] == "prompt"


def test_chunked_body_over_the_limit(server, checker):
    host, port = urllib.parse.urlsplit(server.url).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        try:
            for _ in range(2 * BODY_LIMIT // len(chunk)):
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server may answer and close before the whole body is sent
        head = s.recv(200)
    assert head.startswith(b"HTTP/1.1 413"), head


@pytest.mark.parametrize(
    "raw",
    [
        b"FOO /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10000 + b"\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
        b"garbage\r\n\r\n",
    ],
    ids=["method", "long-target", "content-length", "long-header", "chunk-size", "tls", "garbage"],
)
def test_protocol_garbage(server, raw):
    """Refused by aiohttp's HTTP parser before any middleware runs: a 400, but its own
    text/plain body, not the OpenAI error object (which only the app's middlewares write)."""
    host, port = urllib.parse.urlsplit(server.url).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw)
        head = s.recv(200)
    assert head.split(b" ", 2)[1:2] == [b"400"], head
    assert still_serving(server.url, SERVED) == []


def test_slow_loris_body(server):
    """Headers promise a body that then dribbles in a byte a second: other clients are served
    meanwhile, and the server gives up on that connection (its body deadline, --body-timeout-s
    in SERVE_FLAGS): a 408 with the OpenAI error body, or at least a closed connection."""
    give_up_s = 15.0
    host, port = urllib.parse.urlsplit(server.url).netloc.split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
    t0 = time.monotonic()
    answer = None  # bytes once the server answered or closed (b"")
    try:
        while answer is None and time.monotonic() - t0 < give_up_s:
            assert still_serving(server.url, SERVED, timeout=20) == []
            try:
                s.sendall(b" ")
                s.settimeout(1.0)
                answer = s.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                answer = b""
        assert answer is not None, f"a dribbling body held its connection for {give_up_s}s"
        if answer:
            head, _, body = _whole_answer(s, answer).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), head
            assert json.loads(body)["error"]["code"] == "body_timeout", body
    finally:
        s.close()


def _whole_answer(s: socket.socket, start: bytes) -> bytes:
    """`start` plus the rest of an answer with a Content-Length (until it is all in)."""
    data = start
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _length(data: bytes) -> int:
    m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", data)
    return int(m[1]) if m else 0


def test_served_openapi_matches(server):
    """GET /openapi.json is the document router.openapi builds for the served name."""
    ans = send(server.url, Request("GET", "/openapi.json"))
    assert ans.status == 200, (ans.status, ans.body[:200])
    assert json.loads(ans.body) == json.loads(json.dumps(openapi_document(SERVED)))


def test_stream_answers_end_in_done(server, checker):
    body = {"prompt": "hello there", "max_tokens": 3, "stream": True, "n": 2}
    body["stream_options"] = {"include_usage": True}
    req = json_request("/v1/completions", body)
    ans = send(server.url, req)
    assert ans.status == 200 and checker.problems(req, ans) == []
