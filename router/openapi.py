"""The OpenAPI 3.1 document of the router's HTTP API, built from the parser's own rules.

`openapi_document(served_model_name)` returns a fresh dict on every call (pure: no I/O, no
state); the server answers it at `GET /openapi.json`. The request-body schemas list every field
of the parser's field sets (router/request_fields.py: supported, refused, and unknown names
allowed through `additionalProperties: true`), with the types and bounds that
router/openai_api.py and router/utility_routes.py check. tests/fuzz/test_openapi_document.py
keeps the two in step: a field added to the parser and not here fails it, bodies generated from
these schemas must parse, and a value of a type a field does not list must be refused.

What a JSON schema cannot say (the prompt must fit the model's window, token ids must be below
its vocabulary, `best_of >= n`, a structured-output spec must compile, ...) is listed per
operation under `x-tandem-checks`, {field: rule}; such a request gets a 400 naming the field.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from router import request_fields as rf
from router.openai_api import CHAT_ROLES
from router.tools import _NAME_RE, TOOL_CHOICE_MODES

OPENAPI_VERSION = "3.1.0"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_SCHEMAS = "#/components/schemas/"
_BODY_LIMIT = "the router's --max-body-bytes (8 MiB by default)"

_IGNORED = "comma-separated unknown body fields the router ignored"

Schema = dict[str, Any]


def openapi_document(served_model_name: str) -> dict:
    """The whole document for a router serving `served_model_name`."""
    return {
        "openapi": OPENAPI_VERSION,
        "jsonSchemaDialect": JSON_SCHEMA_DIALECT,
        "info": {
            "title": "tandem router",
            "version": _tandem_version(),
            "description": (
                "OpenAI-compatible completions and chat completions (with vLLM's extra "
                "sampling fields), vLLM's utility routes, health and metrics. Unknown body "
                "fields on the generation routes are accepted, logged, and named back in the "
                "X-Tandem-Ignored-Fields header; refused OpenAI fields get a 400. Unknown "
                "paths get a 404 and wrong methods a 405, both with the OpenAI error body. "
                f"Bodies are read as JSON whatever their Content-Type, up to {_BODY_LIMIT}."
            ),
        },
        "components": {
            "schemas": _schemas(served_model_name),
            "responses": _error_responses(),
            "headers": {
                "RetryAfter": {
                    "description": "seconds to wait",
                    "schema": _t("integer", minimum=0),
                },
                "IgnoredFields": {"description": _IGNORED, "schema": _t("string")},
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        # No key (a server started without --api-key) or the bearer key; /health and /ready
        # never need it, /metrics only with --metrics-require-key (the default).
        "security": [{}, {"bearer": []}],
        "paths": _paths(),
    }


def _tandem_version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


# ------------------------------------------------------------------ small schema builders


def _ref(name: str) -> Schema:
    return {"$ref": _SCHEMAS + name}


def _t(types: str, **keywords: Any) -> Schema:
    """A schema of one JSON type, or of several (`_t("integer|null")`)."""
    names = types.split("|")
    return {"type": names[0] if len(names) == 1 else names, **keywords}


def _obj(props: dict, required: tuple = (), extra: Any = None, **keywords: Any) -> Schema:
    """An object schema; `extra` is its additionalProperties (None: left unsaid)."""
    out: Schema = {"type": "object", "properties": props, **keywords}
    if required:
        out["required"] = list(required)
    if extra is not None:
        out["additionalProperties"] = extra
    return out


def _int(lo: int | None, hi: int | None, text: str) -> Schema:
    bounds = {"minimum": lo} if lo is not None else {}
    if hi is not None:
        bounds["maximum"] = hi
    return _t("integer|null", **bounds, description=text)


def _num(lo: float, hi: float, text: str, lo_open: bool = False) -> Schema:
    low = {"exclusiveMinimum": lo} if lo_open else {"minimum": lo}
    return _t("number|null", **low, maximum=hi, description=text)


def _flag(text: str) -> Schema:
    return _t("boolean|null", description=text)


def _token_ids(min_items: int, types: str = "array") -> Schema:
    item = _t("integer", minimum=0, description="below the vocabulary size")
    return _t(types, minItems=min_items, items=item)


def _refused(name: str) -> Schema:
    """A field tandem refuses unless it is left at its default (request_fields.REFUSED)."""
    defaults: list[Any] = (
        [True, None] if name == "spaces_between_special_tokens" else [None, "", []]
    )
    why = f"refused with a 400 unless left at its default: {rf.REFUSED[name]}"
    return {"enum": defaults, "deprecated": True, "description": why}


def _unused(what: str) -> Schema:
    """A field the parser accepts with any value and never reads."""
    return {"description": f"{what}: accepted, any JSON value, not used"}


def _requires(field: str, flag: str) -> Schema:
    """`field` set (not null) only together with `flag: true`."""
    return {
        "if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
        "then": {"required": [flag], "properties": {flag: {"const": True}}},
    }


# ------------------------------------------------------------------ request bodies


def _structured_fields() -> dict[str, Schema]:
    """vLLM's guided_* constraints: also the keys of `structured_outputs` (without guided_)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json_text = '{"type": "string", "maxLength": 8}'
    return {
        "guided_json": _t(
            "object|string|null",
            description="a JSON schema (an object, or its JSON text) the output must match",
            examples=[schema, json_text],
        ),
        "guided_regex": _t("string|null", minLength=1, examples=["[a-z]{1,8}", "(yes|no)"]),
        "guided_choice": _t(
            "array|null", minItems=1, items=_t("string"), examples=[["yes", "no"], ["a", "b"]]
        ),
        "guided_grammar": _t("string|null", minLength=1, examples=['start: "yes" | "no"']),
    }


def _common_fields(served_model_name: str) -> dict[str, Schema]:
    """Fields both generation routes accept (request_fields._COMMON)."""
    structured = _structured_fields()
    stop = {"type": "string", "minLength": 1}
    return {
        "model": _t(
            "string|null",
            enum=[served_model_name, None],
            description="the served model (GET /v1/models); another name is a 404",
        ),
        "max_tokens": _int(1, None, "tokens to generate; prompt + max_tokens <= max_model_len"),
        "temperature": _num(0, 1e6, "0 is greedy; default from generation_config.json, else 1"),
        "top_p": _num(0, 1, "nucleus sampling mass", lo_open=True),
        "n": _int(1, rf.MAX_N, "choices per prompt"),
        "stream": _flag("answer as server-sent events ending in `data: [DONE]`"),
        "stream_options": _obj(
            {"include_usage": _flag("a last chunk with the usage")},
            extra=True,
            type=["object", "null"],
            description="only with stream: true; other keys are not read",
        ),
        "stop": {
            "anyOf": [stop, _t("array", items=stop), _t("null")],
            "description": "stop strings (not in the output unless asked)",
        },
        "presence_penalty": _num(-2, 2, "OpenAI's presence penalty"),
        "frequency_penalty": _num(-2, 2, "OpenAI's frequency penalty"),
        "logit_bias": _t(
            "object|null",
            maxProperties=300,
            propertyNames={"pattern": "^[0-9]+$"},
            additionalProperties=_t("number", minimum=-100, maximum=100),
            description="token id (below the vocabulary size) -> bias added to its logit",
            examples=[{"15": 5.0, "42": -100}, {}],
        ),
        "seed": _int(-(2**63), 2**64 - 1, "sampling seed (a 64-bit int)"),
        "user": _unused("OpenAI's end-user id"),
        "top_k": _int(-1, None, "-1 or 0: off"),
        "min_p": _num(0, 1, "minimum probability relative to the most likely token"),
        "repetition_penalty": _num(0, 1e6, "vLLM's repetition penalty; 1 is off", lo_open=True),
        "min_tokens": _int(0, None, "EOS and stop token ids are masked until this many tokens"),
        "ignore_eos": _flag("keep generating past EOS"),
        "stop_token_ids": _token_ids(0, "array|null"),
        "include_stop_str_in_output": _flag("keep the matched stop string"),
        "skip_special_tokens": _flag("leave special tokens out of the text (default true)"),
        "spaces_between_special_tokens": _refused("spaces_between_special_tokens"),
        "add_special_tokens": _flag("tokenize the prompt with the tokenizer's special tokens"),
        "response_format": {"anyOf": [_ref("ResponseFormat"), _t("null")]},
        **structured,
        "structured_outputs": _obj(
            {k.removeprefix("guided_"): v for k, v in structured.items()},
            extra=True,
            type=["object", "null"],
            description="vLLM's form of guided_*; when set, the top-level guided_* are not read",
            examples=[{"choice": ["yes", "no"]}, {"regex": "[0-9]{2}"}],
        ),
        "prompt_logprobs": _int(0, rf.MAX_LOGPROBS, "log-probabilities of the prompt tokens"),
    }


def _completion_request(served_model_name: str) -> Schema:
    one = [_t("string", minLength=1), _token_ids(1)]
    batch = _t("array", minItems=1, maxItems=rf.MAX_N, items={"anyOf": one})
    fields = _common_fields(served_model_name) | {
        "prompt": {
            "anyOf": [*one, batch],
            "description": "a string, token ids, or a batch of either (one choice set each)",
        },
        "suffix": _refused("suffix"),
        "logprobs": _int(0, rf.MAX_LOGPROBS, "top log-probabilities per generated token"),
        "echo": _flag("the prompt (and its logprobs) before the answer"),
        "best_of": _int(1, rf.MAX_N, "sample best_of choices, answer the n most likely"),
        "max_tokens": _int(0, None, "tokens to generate; 0 only with echo: true"),
    }
    zero_needs_echo = {
        "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
        "then": {"required": ["echo"], "properties": {"echo": {"const": True}}},
    }
    return _obj(
        fields, ("prompt",), True, allOf=[_requires("stream_options", "stream"), zero_needs_echo]
    )


def _chat_request(served_model_name: str) -> Schema:
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": weather}}
    fields = _common_fields(served_model_name) | {
        "messages": _t("array", minItems=1, items=_ref("ChatMessage")),
        "max_completion_tokens": _int(1, None, "wins over max_tokens"),
        "logprobs": _flag("log-probabilities of the generated tokens"),
        "top_logprobs": _int(0, rf.MAX_LOGPROBS, "alternatives per token; needs logprobs"),
        "tools": _t("array|null", items=_ref("Tool"), examples=[[tool]]),
        "tool_choice": {**_ref("ToolChoice"), "examples": ["none", "auto", None]},
        "parallel_tool_calls": _unused("OpenAI's parallel tool calls switch"),
        "add_generation_prompt": _flag("end the prompt with the assistant turn's opening"),
        "continue_final_message": _flag("continue the last (assistant) message"),
        "echo": _flag("start the answer with the last assistant message's content"),
        "chat_template_kwargs": _t(
            "object|null",
            additionalProperties=True,
            description="extra variables for the chat template",
            examples=[{}, {"enable_thinking": False}],
        ),
        "functions": _refused("functions"),
        "function_call": _refused("function_call"),
    }
    both = {"continue_final_message": {"const": True}, "add_generation_prompt": {"const": True}}
    return _obj(
        fields,
        ("messages",),
        True,
        allOf=[
            _requires("stream_options", "stream"),
            _requires("top_logprobs", "logprobs"),
            {"not": {"required": list(both), "properties": both}},
        ],
    )


def _chat_parts() -> dict[str, Schema]:
    """A chat message and the pieces it is made of (openai_api.MESSAGE_FIELDS)."""
    arguments = {
        "anyOf": [_t("string", contentMediaType="application/json"), _t("object")],
        "description": "JSON text, as OpenAI sends it, or the object",
        "examples": ['{"city": "Paris"}', {"city": "Paris"}],
    }
    function = _obj({"name": _t("string"), "arguments": arguments}, ("name",))
    call = {"id": _t("string"), "type": {"const": "function"}, "function": function}
    text = _obj({"type": {"const": "text"}, "text": _t("string")}, ("type", "text"), True)
    content = {"anyOf": [_t("string"), _t("array", items=_ref("TextPart")), _t("null")]}
    message = {
        "role": {"enum": list(CHAT_ROLES)},
        "content": content,
        "name": _t("string|null"),
        "tool_call_id": _t("string|null"),
        "tool_calls": _t("array|null", items=_ref("ToolCall")),
        "refusal": _unused("OpenAI's refusal text"),
    }
    return {
        "TextPart": {**text, "description": "only text parts are supported"},
        "ToolCall": _obj(call, ("function",), True),
        "ChatMessage": _obj(message, ("role",), False),
    }


def _tool_parts() -> dict[str, Schema]:
    parameters = _t(
        "object|null",
        properties={"type": {"const": "object"}},
        description="a JSON schema of the arguments (an object schema)",
    )
    function = {
        "name": _t("string", pattern=_NAME_RE.pattern),
        "description": _t("string|null"),
        "parameters": parameters,
        "strict": _t("boolean|null"),
    }
    named = _obj({"name": _t("string")}, ("name",))
    fn_type = {"const": "function"}
    return {
        "Tool": _obj(
            {"type": fn_type, "function": _obj(function, ("name",), True)},
            ("type", "function"),
            True,
        ),
        "ToolChoice": {
            "anyOf": [
                {"enum": [*TOOL_CHOICE_MODES, None]},
                _obj({"type": fn_type, "function": named}, ("type", "function")),
            ]
        },
    }


def _response_format() -> Schema:
    holder = _obj(
        {
            "name": _t("string"),
            "schema": _t("object|string", description="object or JSON text"),
            "strict": _t("boolean|null"),
        },
        ("schema",),
    )
    schema = {"type": "object", "properties": {}}
    return {
        "oneOf": [
            _obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
            _obj(
                {"type": {"const": "json_schema"}, "json_schema": holder}, ("type", "json_schema")
            ),
        ],
        "examples": [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        ],
    }


def _utility_requests(served_model_name: str) -> dict[str, Schema]:
    """/tokenize and /detokenize (router/utility_routes.py): unknown fields are refused."""
    model = _common_fields(served_model_name)["model"]
    strs = _flag("also answer the token strings")
    by_prompt = {
        "model": model,
        "prompt": _t("string"),
        "add_special_tokens": _flag("default true"),
        "return_token_strs": strs,
    }
    by_messages = {
        "model": model,
        "messages": _t("array", minItems=1, items=_ref("ChatMessage")),
        "add_generation_prompt": _flag("default true"),
        "return_token_strs": strs,
    }
    return {
        "TokenizeRequest": {
            "oneOf": [_obj(by_prompt, ("prompt",), False), _obj(by_messages, ("messages",), False)]
        },
        "DetokenizeRequest": _obj({"model": model, "tokens": _token_ids(0)}, ("tokens",), False),
    }


# ------------------------------------------------------------------ response bodies


def _response_bodies() -> dict[str, Schema]:
    count = _t("integer", minimum=0)
    tokens = ("prompt_tokens", "completion_tokens", "total_tokens")
    finish = _t("string|null")
    message = _obj({"role": {"const": "assistant"}, "content": _t("string|null")}, ("role",))
    text_choice = {"index": count, "text": _t("string"), "finish_reason": finish}
    chat_choice = {"index": count, "message": message, "finish_reason": finish}

    def answer(kind: str, choice: dict, fields: tuple) -> Schema:
        choice = choice | {"logprobs": _t("object|null")}
        props = {
            "id": _t("string"),
            "object": {"const": kind},
            "created": _t("integer"),
            "model": _t("string"),
            "choices": _t("array", items=_obj(choice, fields)),
            "usage": _ref("Usage"),
            "tandem": _t("object", description="where the request ran"),
        }
        return _obj(props, ("id", "object", "created", "model", "choices", "usage"))

    model = {"id": _t("string"), "object": {"const": "model"}, "max_model_len": count}
    tokenized = {"count": count, "max_model_len": count, "tokens": _token_ids(0)}
    tokenized["token_strs"] = _t("array", items=_t("string|null"))
    workers = _t("object", additionalProperties=count, description="routable workers by role")
    health = {"status": _t("string"), "workers": workers, "inflight": count}
    health["draining"] = _t("boolean")
    ready = {"status": {"enum": ["ready", "not_ready"]}, "workers": workers}
    ready |= {"reason": _t("string"), "message": _t("string")}
    return {
        "Usage": _obj(dict.fromkeys(tokens, count), tokens),
        "Completion": answer("text_completion", text_choice, ("index", "text", "finish_reason")),
        "ChatCompletion": answer(
            "chat.completion", chat_choice, ("index", "message", "finish_reason")
        ),
        "ModelList": _obj(
            {"object": {"const": "list"}, "data": _t("array", items=_obj(model, tuple(model)))},
            ("object", "data"),
        ),
        "Health": _obj(health, ("status",)),
        "Readiness": _obj(ready, ("status",), description="reason: draining, no_decode_workers"),
        "TokenizeResponse": _obj(tokenized, ("count", "max_model_len", "tokens")),
        "DetokenizeResponse": _obj({"prompt": _t("string")}, ("prompt",)),
        "Version": _obj({"version": _t("string")}, ("version",)),
    }


def _schemas(served_model_name: str) -> dict[str, Schema]:
    error = {
        "message": _t("string"),
        "type": _t("string"),
        "param": _t("string|null", description="the field at fault"),
        "code": _t("string|null"),
    }
    return {
        "ErrorBody": _obj(
            {"error": _obj(error, tuple(error))}, ("error",), description="OpenAI's error object"
        ),
        "CompletionRequest": _completion_request(served_model_name),
        "ChatCompletionRequest": _chat_request(served_model_name),
        **_chat_parts(),
        **_tool_parts(),
        "ResponseFormat": _response_format(),
        **_utility_requests(served_model_name),
        **_response_bodies(),
    }


# ------------------------------------------------------------------ errors

# status -> (component name, when, carries Retry-After)
ERRORS = {
    400: ("BadRequest", "invalid JSON or an invalid field (`param` names it)", False),
    401: ("Unauthorized", "missing or wrong bearer key (a server started with --api-key)", False),
    404: ("NotFound", "unknown path, or a `model` other than the served one", False),
    405: ("MethodNotAllowed", "the path exists with another method", False),
    408: ("RequestTimeout", "the body did not arrive within --body-timeout-s", False),
    413: ("PayloadTooLarge", f"the body is over {_BODY_LIMIT}", False),
    429: ("TooManyRequests", "admission is full: retry after Retry-After seconds", True),
    500: ("InternalError", "a worker failed the request", False),
    503: ("ServiceUnavailable", "no worker can take the request now", True),
    504: ("Timeout", "the request ran past --request-timeout-s", False),
}


def _error_responses() -> dict[str, Schema]:
    out = {}
    for name, when, retry in ERRORS.values():
        out[name] = _json(_ref("ErrorBody"), when)
        if retry:
            out[name]["headers"] = {"Retry-After": {"$ref": "#/components/headers/RetryAfter"}}
    return out


def _errors(*statuses: int) -> dict[str, Schema]:
    return {str(s): {"$ref": "#/components/responses/" + ERRORS[s][0]} for s in statuses}


# ------------------------------------------------------------------ paths

_GUIDED = ("json", "regex", "choice", "grammar")
_STRUCTURED_RULE = (
    "one structured-output constraint per request (response_format json_*, guided_*, "
    "structured_outputs, a forced tool_choice); its schema, regex or grammar must compile"
)
_SHARED_CHECKS = {
    "max_tokens": "prompt tokens + max_tokens <= max_model_len (GET /v1/models)",
    "min_tokens": "at most max_model_len",
    "stop_token_ids": "token ids below the vocabulary size",
    "logit_bias": "token ids below the vocabulary size",
    **dict.fromkeys(
        ("response_format", "structured_outputs", *(f"guided_{k}" for k in _GUIDED)),
        _STRUCTURED_RULE,
    ),
}
COMPLETION_CHECKS = {
    **_SHARED_CHECKS,
    "prompt": (
        "each prompt fits in max_model_len with max_tokens; token ids below the vocabulary "
        "size; a text prompt tokenizes to at least one token"
    ),
    "best_of": "best_of >= n; best_of > n cannot be streamed",
}
CHAT_CHECKS = {
    **_SHARED_CHECKS,
    "messages": (
        "the chat template renders them into a prompt that fits in max_model_len; "
        "tool_calls arguments given as text are JSON"
    ),
    "max_completion_tokens": "prompt tokens + max_completion_tokens <= max_model_len",
    "tools": "function names are unique; " + _STRUCTURED_RULE,
    "tool_choice": (
        "a named function is one of the tools; 'required' needs tools; 'auto' with tools needs "
        "a chat template whose tool-call format tandem parses"
    ),
    "continue_final_message": "needs the last message to be the assistant's",
    "chat_template_kwargs": "variables the chat template accepts",
}
TOKENIZE_CHECKS = {"messages": "the chat template renders them (a model without one: 400)"}
DETOKENIZE_CHECKS = {"tokens": "token ids below the vocabulary size"}


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _post(op_id: str, request: str, ok: Schema, statuses: tuple, checks: dict) -> Schema:
    # The router parses the bytes as JSON whatever the Content-Type says.
    body = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    responses = {"200": ok, **_errors(*statuses)}
    op = {"operationId": op_id, "requestBody": body, "responses": responses}
    return {"post": op | {"x-tandem-checks": checks}}


def _generation(op_id: str, request: str, answer: str, checks: dict[str, str]) -> Schema:
    ok = _json(_ref(answer), "the answer (stream: false)")
    sse = _t("string", description="`data: {chunk}` events, then `data: [DONE]`")
    ok["content"]["text/event-stream"] = {"schema": sse}
    ok["headers"] = {"X-Tandem-Ignored-Fields": {"$ref": "#/components/headers/IgnoredFields"}}
    return _post(op_id, request, ok, (400, 401, 404, 408, 413, 429, 500, 503, 504), checks)


def _get(op_id: str, ok: Schema, *statuses: int) -> Schema:
    return {"get": {"operationId": op_id, "responses": {"200": ok, **_errors(401, *statuses)}}}


def _probe(op_id: str, text: str) -> Schema:
    """/health and /ready: no key needed; `/health?ready=1` is /ready."""
    ready = _json(_ref("Readiness"), "not ready: draining, or no decode-capable worker")
    ready["headers"] = {"Retry-After": {"$ref": "#/components/headers/RetryAfter"}}
    op = {"operationId": op_id, "security": [], "responses": {"503": ready}}
    if op_id == "health":
        op["responses"]["200"] = _json(_ref("Health"), text + " (?ready=1: as /ready)")
        flag = _t("string", enum=["1", "true"], description="answer as /ready")
        op["parameters"] = [{"name": "ready", "in": "query", "required": False, "schema": flag}]
    else:
        op["responses"]["200"] = _json(_ref("Readiness"), text)
    return {"get": op}


def _paths() -> dict[str, Schema]:
    prometheus = {
        "description": "Prometheus text",
        "content": {"text/plain": {"schema": _t("string")}},
    }
    utility = (400, 401, 404, 408, 413)
    tokenized = _json(_ref("TokenizeResponse"), "the prompt's token ids")
    detokenized = _json(_ref("DetokenizeResponse"), "the ids' text")
    return {
        "/v1/completions": _generation(
            "createCompletion", "CompletionRequest", "Completion", COMPLETION_CHECKS
        ),
        "/v1/chat/completions": _generation(
            "createChatCompletion", "ChatCompletionRequest", "ChatCompletion", CHAT_CHECKS
        ),
        "/v1/models": _get("listModels", _json(_ref("ModelList"), "the served model")),
        "/health": _probe("health", "liveness: the router serves"),
        "/ready": _probe("ready", "readiness: a decode-capable worker is up, not draining"),
        "/metrics": _get("metrics", prometheus),
        "/openapi.json": _get("openapi", _json(_t("object"), "this document")),
        "/tokenize": _post("tokenize", "TokenizeRequest", tokenized, utility, TOKENIZE_CHECKS),
        "/detokenize": _post(
            "detokenize", "DetokenizeRequest", detokenized, utility, DETOKENIZE_CHECKS
        ),
        "/version": _get("version", _json(_ref("Version"), "tandem's version")),
    }
