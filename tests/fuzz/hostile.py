"""Hypothesis strategies for hostile HTTP requests to the router.

Each strategy draws a `live.Request`:

- `valid_requests(gen)`: bodies of the documented request schemas (valid by the document);
- `wrong_field_requests(gen)`: a valid body with one field (top level or inside a message, a
  tool, a response_format) replaced by a hostile value: every JSON type, huge and special
  numbers written as raw JSON literals (NaN, Infinity, 1e400, 2**64, a 5000-digit integer, -0),
  strings with NUL / control characters / lone surrogates / CRLF, JSON text nested 10^4 deep,
  long arrays and strings;
- `raw_body_requests(gen)`: byte-level damage to a valid body: invalid UTF-8, truncation,
  duplicate keys, a BOM, UTF-16, non-object JSON, empty or random bytes, odd Content-Types;
- `path_requests()`: documented and made-up paths with every common method.
"""

from __future__ import annotations

import copy
import json

from hypothesis import strategies as st

from .live import Request
from .schema_gen import JSON_VALUES, Limits, SchemaGen

# Small enough that each valid request costs a few engine steps on a tiny model: every body
# names its max_tokens, and n / best_of / logprobs stay low.
LIVE_LIMITS = Limits(
    ints={
        "max_tokens": (0, 6),
        "max_completion_tokens": (1, 6),
        "n": (1, 2),
        "best_of": (1, 3),
        "min_tokens": (0, 3),
        "logprobs": (0, 3),
        "top_logprobs": (0, 3),
        "prompt_logprobs": (0, 3),
    },
    always=("max_tokens",),
)
# Request schema per POST route (components.schemas names).
BODIES = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/responses": "ResponsesRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
_RAW = "@@raw{}@@"  # a string placeholder swapped for a raw JSON literal after json.dumps

# Numbers a JSON encoder would not write, or that sit on a type's edge: spliced in as text.
RAW_NUMBERS = (
    "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e308", "-1e308", "-0", "-0.0",
    "5e-324", "18446744073709551616", "18446744073709551615", "-9223372036854775809",
    "1" * 5000, "0." + "0" * 5000 + "1", "1e999999999", "100000000000000000000.0",
)  # fmt: skip
SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
SPECIAL_TEXT = (
    "\x00", "\r\n", "\u2028", "\ufeff", "\u202e", "<|im_start|>", "</s>", "{{ 7*7 }}",
    "{% for x in range(9) %}x{% endfor %}", "%s%n", "\\", '"', "\U0010ffff",
)  # fmt: skip
HOSTILE_TEXT = st.one_of(
    st.text(max_size=40),
    st.lists(SURROGATES | st.sampled_from(SPECIAL_TEXT), min_size=1, max_size=6).map("".join),
    st.builds(lambda c, n: c * n, st.sampled_from("a[{ \x00é"), st.integers(1000, 60000)),
    st.sampled_from(["[" * 10000 + "]" * 10000, "1" * 5000, '{"a":' * 3000 + "1" + "}" * 3000]),
)
HOSTILE_VALUES = st.one_of(
    JSON_VALUES,
    HOSTILE_TEXT,
    st.sampled_from(RAW_NUMBERS).map(lambda t: ("raw", t)),
    st.sampled_from([[], {}, "", 0, False, None, [None], [[]], {"": None}]),
    st.integers(1, 60).map(lambda n: json.loads("[" * n + "]" * n)),
    st.integers(1000, 200000).map(lambda n: [7] * n),
    st.integers(100, 5000).map(lambda n: {str(i): i for i in range(n)}),
)
CONTENT_TYPES = (
    "application/json", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/json; charset=utf-16", "*/*", "",
    "application/octet-stream", "application/json; charset=latin-1",
)  # fmt: skip


def dumps(body: object) -> bytes:
    """JSON text of `body`, where ("raw", text) values become `text` verbatim."""
    raws: list[str] = []

    def swap(value):
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "raw":
            raws.append(value[1])
            return _RAW.format(len(raws) - 1)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(body))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(_RAW.format(i)), raw, 1)
    return text.encode("utf-8", "surrogatepass")


def valid_requests(gen: SchemaGen) -> st.SearchStrategy[Request]:
    return st.one_of(
        [
            gen.body(name).map(lambda b, p=path: Request("POST", p, dumps(b)))
            for path, name in BODIES.items()
        ]
    )


# Places inside a body a hostile value can go, beside every top-level field.
_NESTED = (
    ("messages", 0, "content"), ("messages", 0, "role"), ("messages", 0, "name"),
    ("messages", 0, "tool_calls"), ("messages", 0, "content", 0),
    ("tools", 0, "function", "parameters"), ("tools", 0, "function", "name"),
    ("response_format", "json_schema", "schema"), ("stream_options", "include_usage"),
    ("logit_bias", "5"), ("prompt", 0), ("structured_outputs", "json"),
    ("input", 0, "content"), ("input", 0, "type"), ("input", 0, "call_id"),
    ("text", "format", "schema"), ("text", "format", "type"),
)  # fmt: skip
_SKELETON = {
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}},
    "stream_options": {},
    "logit_bias": {},
    "prompt": ["a"],
    "structured_outputs": {},
    "input": [{"type": "message", "role": "user", "content": "hi"}],
    "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}},
}


def _place(body: dict, where: tuple, value: object) -> dict:
    """`body` with `value` at path `where` (a fresh skeleton where the body has no room)."""
    top, *inner = where
    if not inner:
        return {**body, top: value}
    container = body.get(top)
    if not _fits(container, inner):
        container = copy.deepcopy(_SKELETON[top])
    node = container
    for key in inner[:-1]:
        node = node[key]
    node[inner[-1]] = value
    return {**body, top: container}


def _fits(node: object, keys: list) -> bool:
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, dict) and (last or key in node):
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return False
    return True


@st.composite
def _wrong_field(draw, gen: SchemaGen, path: str) -> Request:
    name = BODIES[path]
    body = draw(gen.body(name))
    schema = gen.resolve(gen.schema(name))
    fields = sorted(schema.get("properties", {})) or ["prompt", "messages", "tokens"]
    where = draw(st.sampled_from([(f,) for f in fields] + list(_NESTED)))
    body = _place(body, where, draw(HOSTILE_VALUES))
    return Request("POST", path, dumps(body))


def wrong_field_requests(gen: SchemaGen) -> st.SearchStrategy[Request]:
    return st.one_of([_wrong_field(gen, path) for path in BODIES])


_DAMAGE = ("utf8", "truncate", "duplicate", "bom", "utf16", "non-object", "empty", "random", "nul")
_BAD_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88")
_REPEATED_KEYS = ("prompt", "model", "messages", "max_tokens", "tokens", "stream")


@st.composite
def _raw_body(draw, gen: SchemaGen) -> Request:
    path = draw(st.sampled_from(sorted(BODIES)))
    text = _damaged(draw, dumps(draw(gen.body(BODIES[path]))), draw(st.sampled_from(_DAMAGE)))
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    headers = (("Content-Type", content_type),) if content_type else ()
    return Request("POST", path, text, headers)


def _damaged(draw, text: bytes, how: str) -> bytes:
    at = draw(st.integers(0, len(text)))
    if how == "utf8":
        return text[:at] + draw(st.sampled_from(_BAD_UTF8)) + text[at:]
    if how == "truncate":
        return text[:at]
    if how == "duplicate":  # the key twice: a hostile value first, the valid one last
        key = json.dumps(draw(st.sampled_from(_REPEATED_KEYS))).encode()
        return b"{" + key + b": " + dumps(draw(HOSTILE_VALUES)) + b", " + text[1:]
    if how == "bom":
        return b"\xef\xbb\xbf" + text
    if how == "utf16":
        return text.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")
    if how == "non-object":
        return dumps(draw(HOSTILE_VALUES.filter(lambda v: not isinstance(v, dict))))
    if how == "empty":
        return b""
    if how == "random":
        return draw(st.binary(max_size=200))
    return text[:at] + b"\x00" + text[at:]


def raw_body_requests(gen: SchemaGen) -> st.SearchStrategy[Request]:
    return _raw_body(gen)


# RFC 3986 path characters: anything else is refused by the HTTP parser itself (see
# test_http_fuzz.test_protocol_garbage), before the router's middlewares could answer.
_PATH_CHARS = st.sampled_from(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,;=:@/"
)


@st.composite
def _path(draw) -> str:
    known = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready",
             "/metrics", "/openapi.json", "/tokenize", "/detokenize", "/version", "/"]  # fmt: skip
    base = draw(st.sampled_from(known))
    tail = draw(
        st.one_of(
            st.just(""),
            st.text(_PATH_CHARS, max_size=30).map(lambda t: "/" + t),
            st.binary(min_size=1, max_size=12).map(lambda b: "/" + _percent(b)),
            st.sampled_from(
                ["/..", "/../health", "//", "/%00", "/%2e%2e/", "?a=1&a=2", "/" + "x" * 4000]
            ),
        )
    )
    path = base.rstrip("/") + tail
    return path if path.startswith("/") else "/" + path


def _percent(data: bytes) -> str:
    return "".join(f"%{b:02X}" for b in data)


def path_requests() -> st.SearchStrategy[Request]:
    bodies = st.sampled_from([b"", b"{}", b'{"prompt": "hi", "max_tokens": 1}'])
    return st.builds(Request, st.sampled_from(METHODS), _path(), bodies)
