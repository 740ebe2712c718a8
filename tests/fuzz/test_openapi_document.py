"""The OpenAPI document (router/openapi.py), generated from the pydantic models of
router/protocol.py, with no server process: a valid OpenAPI 3.1 document whose schemas are
valid JSON Schema 2020-12 with every `$ref` resolving, its request bodies the models' own
schemas, every route the router serves in it (and nothing else), bodies drawn from it parse (or
fail only a check it lists under `x-tandem-checks`), and a value of a JSON type a field does not
list is refused."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from jsonschema import Draft202012Validator

from router import completion_protocol, protocol, utility_routes
from router.errors import APIError
from router.openapi import JSON_SCHEMA_DIALECT, OPENAPI_VERSION

from .conftest import SERVED
from .schema_gen import SchemaGen

MODELS = {
    "CompletionRequest": completion_protocol.CompletionRequest,
    "ChatCompletionRequest": protocol.ChatCompletionRequest,
}
ROUTES = {
    "CompletionRequest": ("/v1/completions", "parse_completion"),
    "ChatCompletionRequest": ("/v1/chat/completions", "parse_chat"),
}
METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def _fields(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def _at(body: dict, path: str):
    """The value at an ignored field's path: `messages[0].content[1].x`, `messages[0].x`,
    `stream_options.x`, `response_format.json_schema.x` (a key may itself hold dots)."""
    if m := re.fullmatch(r"messages\[(\d+)\]\.content\[(\d+)\]\.(.*)", path, re.S):
        return body["messages"][int(m[1])]["content"][int(m[2])][m[3]]
    if m := re.fullmatch(r"messages\[(\d+)\]\.(.*)", path, re.S):
        return body["messages"][int(m[1])][m[2]]
    parent, key = path.split(".", 1)
    if key not in body[parent] and key.startswith("json_schema."):
        return body[parent]["json_schema"][key.removeprefix("json_schema.")]
    return body[parent][key]


def test_request_schemas_are_the_models(doc):
    """components/schemas holds each model's own JSON schema (refs into components), the
    served name as the only `model`; unknown fields are accepted (and named back) on the
    generation routes, refused elsewhere."""
    schemas = doc["components"]["schemas"]
    ref = "#/components/schemas/{model}"
    for model in (*MODELS.values(),
                  protocol.ChatMessage, utility_routes.TokenizePrompt, utility_routes.DetokenizeRequest):  # fmt: skip
        own = model.model_json_schema(ref_template=ref)
        own.pop("$defs", None)
        documented = json.loads(json.dumps(schemas[model.__name__]))
        documented["properties"].pop("model", None)  # the served name, checked below
        own["properties"].pop("model", None)
        assert documented == own, model.__name__
        assert set(schemas[model.__name__]["properties"]) == _fields(model)
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizePrompt"):
        assert schemas[name]["properties"]["model"]["enum"] == [SERVED, None]
    assert schemas["CompletionRequest"]["additionalProperties"] is True
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is True
    for name in ("DetokenizeRequest", "TokenizePrompt", "TokenizeChat", "ChatMessage"):
        assert schemas[name]["additionalProperties"] is False


def test_refused_fields_are_marked_and_checks_name_real_fields(doc):
    gen = SchemaGen(doc)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        refused = {k for k, v in props.items() if v.get("deprecated")}
        assert refused == set(protocol.REFUSED) & set(props)
    for path, item in doc["paths"].items():
        for op in item.values():
            checks = op.get("x-tandem-checks", {})
            if not checks:
                continue
            schema = gen.resolve(op["requestBody"]["content"]["application/json"]["schema"])
            fields = set(schema.get("properties", {}))
            for branch in schema.get("oneOf", []):
                fields |= set(gen.resolve(branch)["properties"])
            assert set(checks) <= fields, (path, set(checks) - fields)


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_document_is_valid_openapi_3_1(doc):
    assert doc["openapi"] == OPENAPI_VERSION and OPENAPI_VERSION.startswith("3.1.")
    assert doc["jsonSchemaDialect"] == JSON_SCHEMA_DIALECT
    assert isinstance(doc["info"]["title"], str) and isinstance(doc["info"]["version"], str)
    assert set(doc["components"]) <= {"schemas", "responses", "headers", "securitySchemes"}
    for path, item in doc["paths"].items():
        assert path.startswith("/") and item and set(item) <= METHODS, path
        for op in item.values():
            assert op["responses"] and all(k.isdigit() for k in op["responses"]), path
            for response in op["responses"].values():
                assert "$ref" in response or isinstance(response["description"], str)
            body = op.get("requestBody")
            if body is not None:
                assert body["content"]["application/json"]["schema"]["$ref"].startswith(
                    "#/components/schemas/"
                )
    json.dumps(doc, allow_nan=False)  # plain JSON: what GET /openapi.json answers
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
        model = MODELS[schema]
        top = [f for f in parsed.ignored_fields if f in body]  # the rest are paths
        not_used = {name for name in model.NOT_USED if body.get(name) is not None}
        if body.get("documents") and "documents" not in str(parser.tokenizer.chat_template):
            not_used.add("documents")  # passed to a chat template that never reads them
        assert sorted(top) == sorted((set(body) - _fields(model)) | not_used)
        for name in set(parsed.ignored_fields) - set(top):  # a set key, named by its path
            assert _at(body, name) not in (None, [], ""), (name, body)
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
