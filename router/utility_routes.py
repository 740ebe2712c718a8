"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /version.

Same paths and bodies as vLLM's OpenAI server, so clients written against it (token counting
before a request, decoding ids from logprobs, version probes) work unchanged:

- /tokenize `{"prompt": str, "add_special_tokens"?: bool = true}` or `{"messages": [...],
  "add_generation_prompt"?: bool = true}` (either with `"model"?` and `"return_token_strs"?`)
  -> `{"count", "max_model_len", "tokens"}`, plus `"token_strs"` when asked for.
- /detokenize `{"tokens": [int]}` -> `{"prompt": str}`.
- /version -> `{"version": str}`.

Every client mistake is an `APIError` (the server's middleware writes the OpenAI error body):
a body that is not a JSON object, a wrong type, a field this route does not know (refused by
name rather than silently ignored, as vLLM's strict models do), a token id outside the
vocabulary. A `model` other than the served one is a 404, as on the generation routes. No
length limit is applied: /tokenize is how a client finds out whether a prompt fits, so it
answers with `max_model_len` beside the count instead (vLLM skips its length check here too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from router import request_fields as rf
from router.body import read_json
from router.errors import bad_request

_PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "return_token_strs"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def add_utility_routes(
    app: web.Application,
    tokenizer: Any,
    served_model_name: str,
    max_model_len: int,
    version: str,
    parse_chat_prompt: Callable[[dict], list[int]] | None,
    body_timeout_s: float = 10.0,
) -> None:
    """Register /tokenize, /detokenize and /version on `app`.

    `parse_chat_prompt(body)` renders `body["messages"]` through the chat template (honouring
    `body["add_generation_prompt"]`) and returns the ids, raising `APIError` for bad input; None
    when the model has no chat template, which makes the messages form a 400.
    """
    routes = _UtilityRoutes(
        tokenizer, served_model_name, max_model_len, version, parse_chat_prompt, body_timeout_s
    )
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/version", routes.version)


class _UtilityRoutes:
    def __init__(
        self,
        tokenizer: Any,
        served_model_name: str,
        max_model_len: int,
        version: str,
        parse_chat_prompt: Callable[[dict], list[int]] | None,
        body_timeout_s: float,
    ) -> None:
        self.body_timeout_s = body_timeout_s
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self._version = version
        self.parse_chat_prompt = parse_chat_prompt
        # len() counts added tokens (the specials), which vocab_size leaves out.
        self.vocab_size = len(tokenizer)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self._version})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._read_body(request)
        if "prompt" in body and "messages" in body:
            raise bad_request("give either 'prompt' or 'messages', not both", param="messages")
        if "messages" in body:
            _check_fields(body, _CHAT_FIELDS)
            add_generation_prompt = _flag(body, "add_generation_prompt", True)
            return_strs = _flag(body, "return_token_strs", False)
            if self.parse_chat_prompt is None:
                raise bad_request(
                    f"model `{self.served_model_name}` has no chat template; tokenize a 'prompt'",
                    param="messages",
                    code="no_chat_template",
                )
            # The chat parser reads the flag from the body: pass it normalised (null -> true).
            ids = list(
                self.parse_chat_prompt({**body, "add_generation_prompt": add_generation_prompt})
            )
        elif "prompt" in body:
            _check_fields(body, _PROMPT_FIELDS)
            add_special_tokens = _flag(body, "add_special_tokens", True)
            return_strs = _flag(body, "return_token_strs", False)
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise bad_request(
                    f"'prompt' must be a string, got {type(prompt).__name__}", param="prompt"
                )
            ids = list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        else:
            raise bad_request(
                "'prompt' or 'messages' is required", param="prompt", code="missing_required"
            )
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len}
        out["tokens"] = ids
        if return_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return web.json_response(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._read_body(request)
        _check_fields(body, _DETOKENIZE_FIELDS)
        tokens = body.get("tokens")
        if tokens is None:
            raise bad_request("'tokens' is required", param="tokens", code="missing_required")
        if not isinstance(tokens, list):
            raise bad_request("'tokens' must be a list of token ids", param="tokens")
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool):
                raise bad_request(f"'tokens' must contain only integers, got {t!r}", "tokens")
            if not 0 <= t < self.vocab_size:
                raise bad_request(
                    f"token id {t} in tokens is outside the vocabulary [0, {self.vocab_size})",
                    param="tokens",
                    code="invalid_token_id",
                )
        # Special tokens are kept, as vLLM's /detokenize does: the ids round-trip to their text.
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def _read_body(self, request: web.Request) -> dict:
        body = await read_json(request, self.body_timeout_s)  # 408 / 413 / 400
        rf.check_body_and_model(body, self.served_model_name)
        return body


def _check_fields(body: dict, allowed: frozenset[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise bad_request(f"unknown field(s) for this request: {names}", param=unknown[0])


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, got {value!r}", param=name)
    return value
