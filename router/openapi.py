"""The OpenAPI 3.1 document of the router's HTTP API, generated from its pydantic models.

`openapi_document(served_model_name)` returns a fresh dict on every call (pure: no I/O); the
server answers it at `GET /openapi.json`. Request bodies are router/protocol.py's models, answers
the models below (the router writes them in router/responses.py; of OpenAI's completion objects
only the fields every client reads, OpenAI's reference being `externalDocs`), all under
components/schemas (`models_json_schema` with a `#/components/schemas/` ref template). What a
JSON schema cannot say (the prompt must fit the window, token ids must be below the vocabulary,
a structured-output spec must compile, ...) is listed per operation under `x-tandem-checks`,
{field: rule}; such a request gets a 400 naming the field.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from engine.protocol import MAX_BAD_WORD_TOKENS
from router.completion_protocol import CompletionRequest
from router.protocol import ChatCompletionRequest, Count
from router.responses_protocol import ResponsesRequest
from router.utility_routes import DetokenizeRequest, TokenizeRequest

OPENAPI_VERSION = "3.1.0"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
OPENAI_REFERENCE = "https://platform.openai.com/docs/api-reference"
_REF = "#/components/schemas/{model}"
_BODY_LIMIT = "the router's --max-body-bytes (8 MiB by default)"


# ------------------------------------------------------------------ answers


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None = Field(description="the field at fault")
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error object."""

    error: ErrorObject


class Usage(BaseModel):
    prompt_tokens: Count
    completion_tokens: Count
    total_tokens: Count


class Choice(BaseModel, extra="allow"):
    """`text` (completions) or `message` (chat), `logprobs`: OpenAI's (externalDocs)."""

    index: Count
    finish_reason: str | None


class Completion(BaseModel):
    """OpenAI's text_completion or chat.completion object: the fields every client reads."""

    id: str
    object: Literal["text_completion", "chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    tandem: dict[str, str] = Field(None, description="where the request ran")
    prompt_token_ids: list[Count] | None = Field(
        None, description="chat with vLLM's return_token_ids (completions: on each choice)"
    )


class ResponseObject(BaseModel, extra="allow"):
    """OpenAI's response object (/v1/responses): the fields every client reads; the
    request's settings are echoed beside them (externalDocs)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]] = Field(description="message and function_call items")
    usage: dict[str, Any] | None = Field(description="input_tokens, output_tokens, ...")


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    max_model_len: Count


class InputTokens(BaseModel):
    object: Literal["response.input_tokens"]
    input_tokens: Count


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    workers: dict[str, Count] = Field(None, description="routable workers by role")
    inflight: Count = 0
    draining: bool = False


class Readiness(BaseModel):
    """reason: draining, no_decode_workers."""

    status: Literal["ready", "not_ready"]
    workers: dict[str, Count] = Field(None, description="routable workers by role")
    reason: str = ""
    message: str = ""


class TokenizeResponse(BaseModel):
    count: Count
    max_model_len: Count
    tokens: list[Count]
    token_strs: list[str | None] = Field(None, description="with return_token_strs")


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


_MODELS = (
    CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
    DetokenizeRequest, ErrorBody, Completion, ResponseObject, ResponseDeleted, ModelList,
    ModelCard, InputTokens, Health, Readiness, TokenizeResponse, DetokenizeResponse, Version,
)  # fmt: skip


@functools.cache
def _schemas() -> dict[str, Any]:
    _, top = models_json_schema([(m, "validation") for m in _MODELS], ref_template=_REF)
    return top["$defs"]


# ------------------------------------------------------------------ checks beyond the schemas

_STRUCTURED_RULE = (
    "one structured-output constraint per request (response_format json_*, guided_*, "
    "structured_outputs, a forced tool_choice); its schema, regex or grammar must compile"
)
_SHARED_CHECKS = {
    "max_tokens": "prompt tokens + max_tokens <= max_model_len (GET /v1/models)",
    "min_tokens": "at most max_model_len",
    "stop_token_ids": "token ids below the vocabulary size",
    "logit_bias": "token ids below the vocabulary size",
    "allowed_token_ids": "token ids below the vocabulary size",
    "bad_words": f"each word at most {MAX_BAD_WORD_TOKENS} tokens",
    "truncate_prompt_tokens": "-1, or 1 to max_model_len",
    "priority": "0 unless the workers run --scheduling-policy priority",
    **dict.fromkeys(("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar"), _STRUCTURED_RULE),
}  # fmt: skip
COMPLETION_CHECKS = {
    **_SHARED_CHECKS,
    "prompt": "each prompt fits in max_model_len with max_tokens; token ids below the "
    "vocabulary size; a text prompt tokenizes to at least one token",
    "best_of": "best_of >= n; best_of > n cannot be streamed",
}
CHAT_CHECKS = {
    **_SHARED_CHECKS,
    "messages": "the chat template renders them into a prompt that fits in max_model_len; "
    "tool_calls arguments given as text are JSON",
    "max_completion_tokens": "prompt tokens + max_completion_tokens <= max_model_len",
    "tools": "function names are unique; " + _STRUCTURED_RULE,
    "tool_choice": "a named function is one of the tools; 'required' needs tools; 'auto' "
    "with tools needs a chat template whose tool-call format tandem parses",
    "continue_final_message": "needs the last message to be the assistant's",
    "chat_template_kwargs": "variables the chat template accepts",
}
RESPONSES_CHECKS = {
    "input": "the chat template renders the conversation (the stored one of "
    "previous_response_id first) into a prompt that fits in max_model_len; a "
    "function_call_output follows a function_call with its call_id",
    "max_output_tokens": "prompt tokens + max_output_tokens <= max_model_len",
    "previous_response_id": "a response this router stored (store not false) and has not "
    "evicted (LRU: --responses-max-stored, --responses-max-stored-bytes); else 400 "
    "previous_response_not_found",
    "tools": "function tools only (built-in tools: 400); names are unique; " + _STRUCTURED_RULE,
    "tool_choice": "a named function is one of the tools; 'required' needs tools; 'auto' "
    "with tools needs a chat template whose tool-call format tandem parses",
    "text": _STRUCTURED_RULE,
}
TOKENIZE_CHECKS = {"messages": "the chat template renders them (a model without one: 400)"}
DETOKENIZE_CHECKS = {"tokens": "token ids below the vocabulary size"}

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


# ------------------------------------------------------------------ the document


def openapi_document(served_model_name: str) -> dict:
    """The whole document for a router serving `served_model_name`."""
    schemas = copy.deepcopy(_schemas())
    for schema in schemas.values():  # `model`: the served one, or left out
        model = schema.get("properties", {}).get("model", {})
        if model.pop("anyOf", None):  # a request's (an answer's is a plain string)
            model["enum"] = [served_model_name, None]
    retry = {"Retry-After": {"$ref": "#/components/headers/RetryAfter"}}
    return {
        "openapi": OPENAPI_VERSION,
        "jsonSchemaDialect": JSON_SCHEMA_DIALECT,
        "info": {
            "title": "tandem router",
            "version": _tandem_version(),
            "description": (
                "OpenAI-compatible completions and chat completions (with vLLM's extra "
                "sampling fields), vLLM's utility routes, health and metrics. Unknown body "
                "fields on the generation routes (and unknown keys of their stream_options, "
                "response_format and structured_outputs, by path) are accepted, logged, and "
                "named back in the X-Tandem-Ignored-Fields header; refused OpenAI fields get a "
                "400. Unknown paths get a 404 and wrong methods a 405, both with the OpenAI "
                "error body. "
                f"Bodies are read as JSON whatever their Content-Type, up to {_BODY_LIMIT}."
            ),
        },
        "externalDocs": {"description": "OpenAI's API reference", "url": OPENAI_REFERENCE},
        "components": {
            "schemas": schemas,
            "responses": {
                name: _json("ErrorBody", when) | ({"headers": retry} if has_retry else {})
                for name, when, has_retry in ERRORS.values()
            },
            "headers": {
                "RetryAfter": {"description": "seconds to wait", "schema": {"type": "integer"}},
                "IgnoredFields": {
                    "description": "comma-separated unknown body fields the router ignored",
                    "schema": {"type": "string"},
                },
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


def _json(model: str | None, description: str) -> dict:
    schema = {"$ref": _REF.format(model=model)} if model else {"type": "object"}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict:
    return {str(s): {"$ref": "#/components/responses/" + ERRORS[s][0]} for s in statuses}


def _post(op_id: str, request: str, ok: dict, statuses: tuple, checks: dict) -> dict:
    # The router parses the bytes as JSON whatever the Content-Type says.
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": _REF.format(
        model=request)}}}}  # fmt: skip
    responses = {"200": ok, **_errors(*statuses)}
    op = {"operationId": op_id, "requestBody": body, "responses": responses}
    return {"post": op | {"x-tandem-checks": checks}}


def _generation(op_id: str, request: str, answer: str, checks: dict[str, str]) -> dict:
    ok = _json(answer, "the answer (stream: false)")
    sse = {"type": "string", "description": "`data: {chunk}` events, then `data: [DONE]`"}
    ok["content"]["text/event-stream"] = {"schema": sse}
    ok["headers"] = {"X-Tandem-Ignored-Fields": {"$ref": "#/components/headers/IgnoredFields"}}
    return _post(op_id, request, ok, (400, 401, 404, 408, 413, 429, 500, 503, 504), checks)


def _get(op_id: str, ok: dict, *statuses: int) -> dict:
    return {"get": {"operationId": op_id, "responses": {"200": ok, **_errors(401, *statuses)}}}


def _probe(op_id: str, text: str) -> dict:
    """/health and /ready: no key needed; `/health?ready=1` is /ready."""
    ready = _json("Readiness", "not ready: draining, or no decode-capable worker")
    ready["headers"] = {"Retry-After": {"$ref": "#/components/headers/RetryAfter"}}
    op: dict = {"operationId": op_id, "security": [], "responses": {"503": ready}}
    if op_id == "health":
        op["responses"]["200"] = _json("Health", text + " (?ready=1: as /ready)")
        flag = {"type": "string", "enum": ["1", "true"], "description": "answer as /ready"}
        op["parameters"] = [{"name": "ready", "in": "query", "required": False, "schema": flag}]
    else:
        op["responses"]["200"] = _json("Readiness", text)
    return {"get": op}


def _stored_response() -> dict:
    """GET / DELETE of a stored response (404 when unknown, not stored or evicted)."""
    param = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    got = _get("getResponse", _json("ResponseObject", "the stored response"), 404)["get"]
    gone = _json("ResponseDeleted", "deleted")
    deleted = {"operationId": "deleteResponse", "responses": {"200": gone, **_errors(401, 404)}}
    return {"get": got | {"parameters": [param]}, "delete": deleted | {"parameters": [param]}}


def _model_route() -> dict:
    """GET one model: the served name or its path (a path holds slashes); else a 404."""
    param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    got = _get("retrieveModel", _json("ModelCard", "the served model"), 404)["get"]
    return {"get": got | {"parameters": [param]}}


def _paths() -> dict:
    prometheus = {"description": "Prometheus text", "content": {"text/plain": {"schema": {
        "type": "string"}}}}  # fmt: skip
    utility = (400, 401, 404, 408, 413)
    ids = _json("TokenizeResponse", "the prompt's token ids")
    text = _json("DetokenizeResponse", "the ids' text")
    return {
        "/v1/completions": _generation(
            "createCompletion", "CompletionRequest", "Completion", COMPLETION_CHECKS
        ),
        "/v1/chat/completions": _generation(
            "createChatCompletion", "ChatCompletionRequest", "Completion", CHAT_CHECKS
        ),
        "/v1/responses": _generation(
            "createResponse", "ResponsesRequest", "ResponseObject", RESPONSES_CHECKS
        ),
        "/v1/responses/input_tokens": _post(
            "countResponseInputTokens",
            "ResponsesRequest",
            _json("InputTokens", "the prompt tokens the body would run; nothing generated"),
            (400, 401, 404, 408, 413),
            RESPONSES_CHECKS,
        ),
        "/v1/responses/{response_id}": _stored_response(),
        "/v1/models": _get("listModels", _json("ModelList", "the served model")),
        "/v1/models/{model}": _model_route(),
        "/health": _probe("health", "liveness: the router serves"),
        "/ready": _probe("ready", "readiness: a decode-capable worker is up, not draining"),
        "/metrics": _get("metrics", prometheus),
        "/openapi.json": _get("openapi", _json(None, "this document")),
        "/tokenize": _post("tokenize", "TokenizeRequest", ids, utility, TOKENIZE_CHECKS),
        "/detokenize": _post("detokenize", "DetokenizeRequest", text, utility, DETOKENIZE_CHECKS),
        "/version": _get("version", _json("Version", "tandem's version")),
    }
