"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /version.

Same paths and bodies as vLLM's OpenAI server, so clients written against it (token counting
before a request, decoding ids from logprobs, version probes) work unchanged:

- /tokenize `{"prompt": str, "add_special_tokens"?: bool = true}` or `{"messages": [...],
  "add_generation_prompt"?: bool = true}` (either with `"model"?` and `"return_token_strs"?`)
  -> `{"count", "max_model_len", "tokens"}`, plus `"token_strs"` when asked for.
- /detokenize `{"tokens": [int]}` -> `{"prompt": str}`.
- /version -> `{"version": str}`.

Every client mistake is an `APIError` (the server's middleware writes the OpenAI error body): the
bodies are router/protocol.py's `TokenizeRequest` / `DetokenizeRequest`, which refuse unknown
fields by name (as vLLM's strict models do), wrong types, token ids outside the vocabulary, and
a `model` other than the served one (404). No length limit is applied: /tokenize is how a client
finds out whether a prompt fits, so it answers with `max_model_len` beside the count instead
(vLLM skips its length check here too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from aiohttp import web
from pydantic import Discriminator, RootModel, Tag

from router.errors import bad_request
from router.openai_api import read_body, validate
from router.protocol import Limits, Messages, ModelName, StrictModel, TokenId, flag


class _Tokenize(StrictModel):
    model: ModelName = None
    return_token_strs: bool | None = flag("also answer the token strings")


class TokenizePrompt(_Tokenize):
    prompt: str
    add_special_tokens: bool | None = flag("default true")


class TokenizeChat(_Tokenize):
    add_generation_prompt: bool | None = flag("default true")
    messages: Messages


def _tokenize_form(body: Any) -> str | None:
    if not isinstance(body, dict) or "messages" not in body:
        return "<prompt>"
    return None if "prompt" in body else "<messages>"


class TokenizeRequest(RootModel):
    root: Annotated[
        Annotated[TokenizePrompt, Tag("<prompt>")] | Annotated[TokenizeChat, Tag("<messages>")],
        Discriminator(
            _tokenize_form,
            custom_error_type="invalid_value",
            custom_error_message="give either 'prompt' or 'messages', not both",
            custom_error_context={"param": "messages"},
        ),
    ]


class DetokenizeRequest(StrictModel):
    model: ModelName = None
    tokens: list[TokenId]


def add_utility_routes(
    app: web.Application,
    tokenizer: Any,
    served_model_name: str,
    max_model_len: int,
    version: str,
    parse_chat_prompt: Callable[[dict], list[int]] | None,
    body_timeout_s: float = 10.0,
    model_aliases: tuple[str, ...] = (),
) -> None:
    """Register /tokenize, /detokenize and /version on `app`.

    `parse_chat_prompt(body)` renders `body["messages"]` through the chat template (honouring
    `body["add_generation_prompt"]`) and returns the ids, raising `APIError` for bad input; None
    when the model has no chat template, which makes the messages form a 400.
    """
    # len() counts added tokens (the specials), which vocab_size leaves out.
    limits = Limits(served_model_name, len(tokenizer), max_model_len, model_aliases)

    async def tokenize(request: web.Request) -> web.Response:
        raw = await read_body(request, body_timeout_s)  # 408 / 413 / 400
        body = validate(TokenizeRequest, raw, limits).root
        if isinstance(body, TokenizeChat):
            if parse_chat_prompt is None:
                raise bad_request(
                    f"model `{served_model_name}` has no chat template; tokenize a 'prompt'",
                    param="messages",
                    code="no_chat_template",
                )
            messages = [m.model_dump(exclude_unset=True) for m in body.messages]
            gen = body.add_generation_prompt is not False
            ids = list(parse_chat_prompt({"messages": messages, "add_generation_prompt": gen}))
        else:
            add_special = body.add_special_tokens is not False
            ids = list(tokenizer(body.prompt, add_special_tokens=add_special)["input_ids"])
        out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return web.json_response(out)

    async def detokenize(request: web.Request) -> web.Response:
        raw = await read_body(request, body_timeout_s)  # 408 / 413 / 400
        tokens = validate(DetokenizeRequest, raw, limits).tokens
        # Special tokens are kept, as vLLM's /detokenize does: the ids round-trip to their text.
        return web.json_response({"prompt": tokenizer.decode(tokens)})

    async def version_route(request: web.Request) -> web.Response:
        return web.json_response({"version": version})

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version_route)
