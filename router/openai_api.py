"""OpenAI request parsing and validation: JSON body -> `ParsedRequest` (or an `APIError` 4xx).

Every check that can fail on client input happens here, before anything is sent to a worker,
so a bad request costs no worker time and can never surface as a 5xx.

Defaults (as vLLM): `max_tokens` absent -> 16 for /v1/completions (the OpenAI legacy default),
capped by the room left in the context window; for /v1/chat/completions the whole room left
(`max_model_len - prompt_tokens`). An explicit value must be >= 1 and fit in the window together
with the prompt; chat's `max_completion_tokens` wins over `max_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from router.errors import APIError, bad_request

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    extra: dict = field(default_factory=dict)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class RequestParser:
    """Turns request bodies into `ParsedRequest`s for one model (tokenizer + limits)."""

    def __init__(
        self,
        tokenizer: Any,
        served_model_name: str,
        max_model_len: int,
        vocab_size: int,
        completion_default_max_tokens: int = 16,
    ) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.completion_default_max_tokens = completion_default_max_tokens
        # No token covers more characters than its longest vocabulary string, so text longer
        # than this cannot fit in the window: refuse it without paying to tokenize it.
        try:
            longest = max(len(t) for t in tokenizer.get_vocab())
        except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: no shortcut
            longest = 0
        self.max_prompt_chars = 2 * max_model_len * longest if longest else None

    def _tokenize(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens, and "
                f"the {param} ({len(text)} characters) is far longer than that.",
                param,
                code="context_length_exceeded",
            )
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    # ------------------------------------------------------------------ entry points

    def parse_completion(self, body: Any) -> ParsedRequest:
        body = self._check_common(body)
        for name in ("echo",):
            if body.get(name):
                raise bad_request(f"'{name}' is not supported", param=name)
        if body.get("suffix") is not None:
            raise bad_request("'suffix' is not supported", param="suffix")
        if body.get("logprobs") not in (None, 0, False):
            raise bad_request("'logprobs' is not supported", param="logprobs")
        if body.get("best_of") not in (None, 1):
            raise bad_request("'best_of' must be 1", param="best_of")
        if "prompt" not in body or body["prompt"] is None:
            raise bad_request("'prompt' is required", param="prompt", code="missing_required")
        prompt_ids = self._completion_prompt_ids(body["prompt"])
        max_tokens = self._max_tokens(
            body, ("max_tokens",), len(prompt_ids), default_cap=(self.completion_default_max_tokens)
        )
        return self._build("completion", body, prompt_ids, max_tokens)

    def parse_chat(self, body: Any) -> ParsedRequest:
        body = self._check_common(body)
        if body.get("logprobs") not in (None, False):
            raise bad_request("'logprobs' is not supported", param="logprobs")
        if body.get("tools"):
            raise bad_request("'tools' are not supported", param="tools")
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise bad_request(
                "only response_format {'type': 'text'} is supported", "response_format"
            )
        if "messages" not in body or body["messages"] is None:
            raise bad_request("'messages' is required", param="messages", code="missing_required")
        messages = self._chat_messages(body["messages"])
        prompt_ids = self._apply_chat_template(messages)
        names = ("max_completion_tokens", "max_tokens")
        max_tokens = self._max_tokens(body, names, len(prompt_ids), default_cap=None)
        return self._build("chat", body, prompt_ids, max_tokens)

    # ------------------------------------------------------------------ shared checks

    def _check_common(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise bad_request(
                f"request body must be a JSON object, got {type(body).__name__}",
                code="invalid_json",
            )
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise bad_request("'model' must be a string", param="model")
            if model != self.served_model_name:
                raise APIError(
                    404,
                    f"The model `{model}` does not exist; this server serves "
                    f"`{self.served_model_name}`.",
                    param="model",
                    code="model_not_found",
                )
        n = body.get("n")
        if n is not None and (not _is_int(n) or n != 1):
            raise bad_request("only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            v = body.get(name)
            if v is not None and (not _is_number(v) or v != 0):
                raise bad_request(f"'{name}' is not supported (must be 0)", param=name)
        rp = body.get("repetition_penalty")
        if rp is not None and (not _is_number(rp) or rp != 1):
            raise bad_request(
                "'repetition_penalty' is not supported (must be 1)", "repetition_penalty"
            )
        if body.get("logit_bias"):
            raise bad_request("'logit_bias' is not supported", param="logit_bias")
        return body

    def _build(
        self, kind: str, body: dict, prompt_ids: list[int], max_tokens: int
    ) -> ParsedRequest:
        # Checks run in a fixed order so a body with several mistakes always names the same one.
        sampling = self._sampling_fields(body)
        stop = self._stop_strings(body.get("stop"))
        stream, include_usage = self._stream_flags(body)
        return ParsedRequest(
            kind=kind,
            model=self.served_model_name,
            prompt_ids=prompt_ids,
            sampling=SamplingParams(max_tokens=max_tokens, **sampling),
            stop=stop,
            stream=stream,
            include_usage=include_usage,
        )

    def _sampling_fields(self, body: dict) -> dict[str, Any]:
        """The validated SamplingParams fields other than max_tokens."""
        temperature = body.get("temperature")
        if temperature is None:
            temperature = 1.0
        if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
            raise bad_request(
                f"temperature must be a number >= 0, got {temperature!r}", "temperature"
            )
        top_p = body.get("top_p")
        if top_p is None:
            top_p = 1.0
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise bad_request(f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
        top_k = body.get("top_k")
        if top_k is None or top_k == 0:
            top_k = -1  # vLLM: 0 and -1 both mean "no top-k"
        if not _is_int(top_k) or top_k < -1:
            raise bad_request(f"top_k must be -1, 0 or a positive int, got {top_k!r}", "top_k")
        seed = body.get("seed")
        if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
            raise bad_request(f"seed must be a 64-bit int, got {seed!r}", "seed")
        ignore_eos = body.get("ignore_eos", False)
        if ignore_eos is None:
            ignore_eos = False
        if not isinstance(ignore_eos, bool):
            raise bad_request("ignore_eos must be a boolean", "ignore_eos")
        stop_token_ids = body.get("stop_token_ids")
        if stop_token_ids is None:
            stop_token_ids = []
        if not isinstance(stop_token_ids, list):
            raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
        self._check_token_ids(stop_token_ids, "stop_token_ids")
        return {
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": top_k,
            "seed": seed,
            "stop_token_ids": tuple(stop_token_ids),
            "ignore_eos": ignore_eos,
        }

    @staticmethod
    def _stream_flags(body: dict) -> tuple[bool, bool]:
        """(stream, stream_options.include_usage)."""
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise bad_request("stream must be a boolean", "stream")
        opts = body.get("stream_options")
        if opts is None:
            return stream, False
        if not isinstance(opts, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        include_usage = opts.get("include_usage", False)
        if include_usage is None:
            include_usage = False
        if not isinstance(include_usage, bool):
            raise bad_request("stream_options.include_usage must be a boolean", "stream_options")
        return stream, include_usage

    def _max_tokens(
        self, body: dict, names: tuple[str, ...], prompt_len: int, default_cap: int | None
    ) -> int:
        limit = self.max_model_len
        room = limit - prompt_len
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, and the prompt has "
                f"{prompt_len} tokens, which leaves no room for a completion. Please shorten "
                "the prompt.",
                param="messages" if "max_completion_tokens" in names else "prompt",
                code="context_length_exceeded",
            )
        for name in names:
            value = body.get(name)
            if value is None:
                continue
            if not _is_int(value):
                raise bad_request(f"'{name}' must be an integer, got {value!r}", param=name)
            if value < 1:
                raise bad_request(f"'{name}' must be at least 1, got {value}", param=name)
            if value > room:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {prompt_len + value} tokens ({prompt_len} in the prompt, {value} "
                    f"in the completion). Please reduce the prompt or '{name}'.",
                    param=name,
                    code="context_length_exceeded",
                )
            return value
        return room if default_cap is None else min(default_cap, room)

    def _stop_strings(self, stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop must be a string or a list of strings", "stop")
        if any(not s for s in stop):
            raise bad_request("stop strings must not be empty", "stop")
        return tuple(dict.fromkeys(stop))

    def _check_token_ids(self, ids: list, param: str) -> None:
        for t in ids:
            if not _is_int(t):
                raise bad_request(f"{param} must contain only integers, got {t!r}", param)
            if not 0 <= t < self.vocab_size:
                raise bad_request(
                    f"token id {t} in {param} is outside the vocabulary [0, {self.vocab_size})",
                    param,
                    code="invalid_token_id",
                )

    # ------------------------------------------------------------------ prompts

    def _completion_prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list):
            self._check_token_ids(prompt, "prompt")  # a flat list: token ids
            return list(prompt)
        if isinstance(prompt, list):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt", code="empty_prompt")
            if len(prompt) > 1:
                raise bad_request(
                    f"a list of {len(prompt)} prompts is not supported; send one prompt per "
                    "request",
                    "prompt",
                )
            prompt = prompt[0]
            if isinstance(prompt, list):
                if not prompt:
                    raise bad_request("prompt must not be empty", "prompt", code="empty_prompt")
                self._check_token_ids(prompt, "prompt")
                return list(prompt)
        if not isinstance(prompt, str):
            raise bad_request(
                "prompt must be a string, a list of token ids, or a one-element list of either",
                "prompt",
            )
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt", code="empty_prompt")
        ids = self._tokenize(prompt, "prompt", add_special_tokens=True)
        if not ids:
            raise bad_request("prompt tokenizes to no tokens", "prompt", code="empty_prompt")
        return ids

    def _chat_messages(self, messages: Any) -> list[dict]:
        if not isinstance(messages, list):
            raise bad_request("messages must be a list of message objects", "messages")
        if not messages:
            raise bad_request("messages must not be empty", "messages", code="empty_prompt")
        out = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise bad_request(f"messages[{i}] must be an object", "messages")
            role = msg.get("role")
            if not isinstance(role, str):
                raise bad_request(f"messages[{i}].role must be a string", "messages")
            if role not in CHAT_ROLES:
                raise bad_request(
                    f"messages[{i}].role {role!r} is not one of {', '.join(CHAT_ROLES)}",
                    "messages",
                )
            out.append({"role": role, "content": self._message_text(msg.get("content"), i)})
        return out

    @staticmethod
    def _message_text(content: Any, i: int) -> str:
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad_request(
                        f"messages[{i}].content: only text parts are supported", "messages"
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    raise bad_request(f"messages[{i}].content: text must be a string", "messages")
                parts.append(text)
            return "\n".join(parts)
        raise bad_request(f"messages[{i}].content must be a string or a list of parts", "messages")

    def _apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                f"model `{self.served_model_name}` has no chat template; use /v1/completions",
                "messages",
                code="no_chat_template",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # jinja raises its own errors (e.g. roles must alternate)
            raise bad_request(f"chat template failed: {e}", "messages") from e
        # The template already wrote BOS and the turn markers.
        ids = self._tokenize(text, "messages", add_special_tokens=False)
        if not ids:
            raise bad_request("messages render to an empty prompt", "messages", code="empty_prompt")
        return ids
