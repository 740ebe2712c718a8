"""The OpenAPI document (router/openapi.py) against the parser it describes, with no server
process: its body fields are exactly the parser's field sets, it is valid JSON Schema 2020-12
with every `$ref` resolving, every route the router serves is in it (and nothing else), bodies
drawn from its schemas parse (or fail only a check it lists under `x-tandem-checks`), and a
value of a JSON type a field does not list is refused."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from jsonschema import Draft202012Validator

from router import request_fields as rf
from router.errors import APIError
from router.openai_api import MESSAGE_FIELDS
from router.openapi import JSON_SCHEMA_DIALECT, OPENAPI_VERSION
from router.utility_routes import _CHAT_FIELDS, _DETOKENIZE_FIELDS, _PROMPT_FIELDS

from .conftest import SERVED
from .schema_gen import SchemaGen

ROUTES = {
    "CompletionRequest": ("/v1/completions", "parse_completion"),
    "ChatCompletionRequest": ("/v1/chat/completions", "parse_chat"),
}


def _props(doc: dict, name: str) -> set[str]:
    return set(doc["components"]["schemas"][name]["properties"])


def test_body_fields_are_the_parsers_field_sets(doc):
    assert _props(doc, "CompletionRequest") == rf.COMPLETION_FIELDS
    assert _props(doc, "ChatCompletionRequest") == rf.CHAT_FIELDS
    assert _props(doc, "ChatMessage") == MESSAGE_FIELDS
    by_prompt, by_messages = doc["components"]["schemas"]["TokenizeRequest"]["oneOf"]
    assert set(by_prompt["properties"]) == _PROMPT_FIELDS
    assert set(by_messages["properties"]) == _CHAT_FIELDS
    assert _props(doc, "DetokenizeRequest") == _DETOKENIZE_FIELDS
    # Unknown fields: accepted (and named back) on the generation routes, refused elsewhere.
    schemas = doc["components"]["schemas"]
    assert schemas["CompletionRequest"]["additionalProperties"] is True
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is True
    assert schemas["DetokenizeRequest"]["additionalProperties"] is False
    assert by_prompt["additionalProperties"] is by_messages["additionalProperties"] is False


def test_refused_fields_are_marked_and_checks_name_real_fields(doc):
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        refused = {k for k, v in props.items() if v.get("deprecated")}
        assert refused == set(rf.REFUSED) & set(props)
    for path, item in doc["paths"].items():
        for op in item.values():
            checks = op.get("x-tandem-checks", {})
            if not checks:
                continue
            schema = SchemaGen(doc).resolve(
                op["requestBody"]["content"]["application/json"]["schema"]
            )
            fields = set(schema.get("properties", {}))
            for branch in schema.get("oneOf", []):
                fields |= set(branch["properties"])
            assert set(checks) <= fields, (path, set(checks) - fields)


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_document_is_valid_json_schema_2020_12(doc):
    assert doc["openapi"] == OPENAPI_VERSION and OPENAPI_VERSION.startswith("3.1.")
    assert doc["jsonSchemaDialect"] == JSON_SCHEMA_DIALECT
    assert Draft202012Validator.META_SCHEMA["$id"] == JSON_SCHEMA_DIALECT
    for schema in doc["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)  # raises SchemaError naming the keyword
    gen = SchemaGen(doc)
    refs = _refs(doc)
    assert len(refs) > 20
    for ref in set(refs):
        node = doc
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]  # a dangling $ref is a KeyError here
        assert isinstance(node, dict)
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
    # Errors are OpenAI's error object; the ones a client should retry say when.
    responses = doc["components"]["responses"]
    for name in ("TooManyRequests", "ServiceUnavailable"):
        assert "Retry-After" in responses[name]["headers"]
    error = {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    assert gen.validator("ErrorBody").is_valid(error)
    assert not gen.validator("ErrorBody").is_valid({"error": "m"})


async def _served_routes(fuzz_model) -> set[tuple[str, str]]:
    from router.config import RouterConfig
    from router.directory import StaticDirectory
    from router.server import RouterServer, load_model_info

    config = RouterConfig(model_path=str(fuzz_model), served_model_name=SERVED, port=0)
    server = RouterServer(config, StaticDirectory([]), model_info=load_model_info(config))
    await server.start()
    try:
        routes = server._runner.app.router.routes()
        return {(r.method, r.resource.canonical) for r in routes if r.method != "HEAD"}
    finally:
        await server.stop()


def test_every_served_route_is_documented_and_nothing_else(doc, fuzz_model):
    """The routes of a real RouterServer's aiohttp app (HEAD aside: aiohttp adds it to GETs)."""
    served = asyncio.run(_served_routes(fuzz_model))
    documented = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    assert served - documented == set(), "served but not documented"
    assert documented - served == set(), "documented but not served"


@pytest.mark.parametrize("schema", sorted(ROUTES))
def test_bodies_drawn_from_the_document_parse(doc, parser, schema):
    """Valid by the document -> parsed, or a 400 naming a field whose rule the document
    lists under x-tandem-checks (the window, the vocabulary, a spec that must compile...)."""
    path, method = ROUTES[schema]
    checks = doc["paths"][path]["post"]["x-tandem-checks"]
    parse = getattr(parser, method)
    outcomes: Counter[str] = Counter()

    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(body=SchemaGen(doc).body(schema))
    def run(body):
        try:
            parsed = parse(body)
        except APIError as e:
            assert e.status == 400 and e.param in checks, (e.status, e.param, e.message, body)
            outcomes[f"400 {e.param}"] += 1
            return
        known = rf.COMPLETION_FIELDS if schema == "CompletionRequest" else rf.CHAT_FIELDS
        assert parsed.ignored_fields == sorted(set(body) - known)
        outcomes["parsed"] += 1

    run()
    assert outcomes["parsed"] >= 0.8 * sum(outcomes.values()), outcomes


# One value per JSON type: truthy and falsy, so a check written as `if not value` shows.
_OF_TYPE = {
    "null": [None],
    "boolean": [True, False],
    "integer": [3, 0],
    "number": [1.5],
    "string": ["x", ""],
    "array": [[1], []],
    "object": [{"x": 1}, {}],
}
_BASES = {
    "CompletionRequest": {"prompt": "hello there", "max_tokens": 2},
    "ChatCompletionRequest": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


def _types(gen: SchemaGen, schema: dict) -> set[str]:
    """The JSON types a property's schema admits (empty: any value)."""
    schema = gen.resolve(schema)
    kind = schema.get("type")
    if kind is not None:
        return {kind} if isinstance(kind, str) else set(kind)
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    out = {_json_type(v) for v in values}
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key, []):
            out |= _types(gen, branch)
    return out


def _json_type(value) -> str:
    names = {type(None): "null", bool: "boolean", int: "integer", float: "number"}
    return names.get(type(value)) or {str: "string", list: "array", dict: "object"}[type(value)]


def _wrong_values(types: set[str]) -> list:
    wrong = []
    for kind, values in _OF_TYPE.items():
        if kind in types or (kind == "integer" and "number" in types):
            continue
        wrong += values
    return wrong


def test_values_of_undocumented_types_are_refused(doc, parser):
    """Every field's documented types are the only ones the parser takes; falsy values too,
    so a field read as `if not value` or `value == 0` shows (tests/fuzz/README.md)."""
    gen = SchemaGen(doc)
    accepted = []
    for schema, (_, method) in ROUTES.items():
        base = _BASES[schema]
        props = doc["components"]["schemas"][schema]["properties"]
        targets = list(props.items())
        if schema == "ChatCompletionRequest":
            message = doc["components"]["schemas"]["ChatMessage"]["properties"]
            targets += [(f"messages[].{k}", v) for k, v in message.items()]
        for name, prop in targets:
            types = _types(gen, prop)
            if not types:
                continue  # documented as any value (user, parallel_tool_calls, refusal)
            for value in _wrong_values(types):
                body = _with(base, name, value)
                try:
                    getattr(parser, method)(body)
                except APIError as e:
                    assert e.status in (400, 404), (name, value, e.status)
                    continue
                accepted.append(f"{schema}.{name} = {value!r}")
    assert accepted == [], "\n".join(accepted)


def _with(base: dict, name: str, value) -> dict:
    if name.startswith("messages[]."):
        return {**base, "messages": [{**base["messages"][0], name.split(".", 1)[1]: value}]}
    return {**base, name: value}
