"""OpenAI request parsing and validation: JSON body -> `ParsedRequest` (or an `APIError` 4xx).

Every check that can fail on client input happens here, before anything is sent to a worker,
so a bad request costs no worker time and can never surface as a 5xx. Which fields exist and
the shared sampling / structured-output checks are in router/request_fields.py.

Sampling defaults come from the model's generation_config.json (temperature, top_p, top_k,
min_p, repetition_penalty), as vLLM applies them, then OpenAI's.

Defaults (as vLLM): `max_tokens` absent -> 16 for /v1/completions (the OpenAI legacy default),
capped by the room left in the context window; for /v1/chat/completions the whole room left
(`max_model_len - prompt_tokens`). An explicit value must be >= 1 and fit in the window together
with the prompt; chat's `max_completion_tokens` wins over `max_tokens`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.sampling_params import SamplingParams
from router import request_fields as rf
from router.errors import bad_request
from router.request_fields import is_int as _is_int

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams  # what the engine runs (its n is best_of when that is larger)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    extra: dict = field(default_factory=dict)
    # Every prompt of a completions batch (prompt_ids is the first); one engine request each.
    prompts: list[list[int]] = field(default_factory=list)
    n: int = 1  # choices answered per prompt
    logprobs: int | None = None  # top log-probabilities per token in the answer; None: off
    echo: bool = False  # completions: the prompt (and its logprobs) before the answer
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, nothing generated
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    tools: list | None = None
    tool_choice: Any = None
    tool_format: str | None = None  # the parser of "auto" tool calls (router/tools.py)
    ignored_fields: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompts:
            self.prompts = [self.prompt_ids]


class RequestParser:
    """Turns request bodies into `ParsedRequest`s for one model (tokenizer + limits)."""

    def __init__(
        self,
        tokenizer: Any,
        served_model_name: str,
        max_model_len: int,
        vocab_size: int,
        completion_default_max_tokens: int = 16,
        generation_defaults: dict | None = None,
        check_structured: Callable[[str, str], None] | None = None,
        tool_format: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.completion_default_max_tokens = completion_default_max_tokens
        self.defaults = dict(generation_defaults or {})
        # Compiles a structured-output spec (raises ValueError naming the problem) so a bad
        # schema is a 400 here, not an error from a worker.
        self.check_structured = check_structured
        self.tool_format = tool_format
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
        body = self._check_common(body, rf.COMPLETION_FIELDS)
        if "prompt" not in body or body["prompt"] is None:
            raise bad_request("'prompt' is required", param="prompt", code="missing_required")
        add_special = rf.optional_bool(body, "add_special_tokens", True)
        prompts = self._completion_prompts(body["prompt"], add_special)
        echo = rf.optional_bool(body, "echo", False)
        logprobs = rf.count(body, "logprobs", None, 0, rf.MAX_LOGPROBS)
        if body.get("logprobs") is False:
            logprobs = None
        longest = max(len(p) for p in prompts)
        echo_only = echo and body.get("max_tokens") == 0
        names = () if echo_only else ("max_tokens",)
        max_tokens = self._max_tokens(
            body, names, longest, default_cap=self.completion_default_max_tokens
        )
        parsed = self._build("completion", body, prompts, max_tokens, logprobs)
        parsed.echo, parsed.echo_only = echo, echo_only
        best_of = rf.count(body, "best_of", None, 1, rf.MAX_N)
        if best_of is not None:
            self._best_of(parsed, best_of)
        if echo and logprobs is not None:
            parsed.sampling = replace(parsed.sampling, prompt_logprobs=logprobs)
        return parsed

    def _best_of(self, parsed: ParsedRequest, best_of: int) -> None:
        """best_of: sample best_of choices, answer the n with the highest cumulative logprob
        (the engine's n is best_of; every choice reports its logprobs to rank them)."""
        if best_of < parsed.n:
            raise bad_request(f"best_of ({best_of}) must be >= n ({parsed.n})", "best_of")
        if best_of > parsed.n and parsed.stream:
            raise bad_request("best_of > n cannot be streamed", "best_of")
        if best_of > parsed.n:
            sp = parsed.sampling
            parsed.sampling = replace(sp, n=best_of, logprobs=sp.logprobs or 0)

    def parse_chat(self, body: Any) -> ParsedRequest:
        body = self._check_common(body, rf.CHAT_FIELDS)
        if "messages" not in body or body["messages"] is None:
            raise bad_request("'messages' is required", param="messages", code="missing_required")
        messages = self._chat_messages(body["messages"])
        tools, tool_choice = self._tools(body)
        prompt_ids = self._apply_chat_template(messages, body, tools)
        names = ("max_completion_tokens", "max_tokens")
        max_tokens = self._max_tokens(body, names, len(prompt_ids), default_cap=None)
        logprobs = None
        top = rf.count(body, "top_logprobs", None, 0, rf.MAX_LOGPROBS)
        if rf.optional_bool(body, "logprobs", False):
            logprobs = top or 0
        elif top is not None:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        parsed = self._build("chat", body, [prompt_ids], max_tokens, logprobs, tools, tool_choice)
        if rf.optional_bool(body, "echo", False) and messages[-1]["role"] == "assistant":
            parsed.extra["echo_text"] = messages[-1]["content"]
        return parsed

    def chat_prompt_ids(self, body: dict) -> list[int]:
        """The prompt a chat body renders to (for /tokenize)."""
        messages = self._chat_messages(body.get("messages"))
        tools, _ = self._tools(body)
        return self._apply_chat_template(messages, body, tools)

    def _tools(self, body: dict) -> tuple[list | None, Any]:
        from router.tools import validate_tools

        tools, choice = body.get("tools"), body.get("tool_choice")
        if tools is not None and not isinstance(tools, list):  # 0, false, "", {}: refused
            raise bad_request(f"tools must be a list, got {type(tools).__name__}", "tools")
        if not tools:
            if choice not in (None, "none", "auto"):
                raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
            return None, None
        try:
            validate_tools(tools, choice)
        except ValueError as e:
            param = "tool_choice" if "tool_choice" in str(e) else "tools"
            raise bad_request(str(e), param) from e
        return tools, "auto" if choice is None else choice

    # ------------------------------------------------------------------ shared checks

    def _check_common(self, body: Any, known: set[str]) -> dict:
        body = rf.check_body_and_model(body, self.served_model_name)
        rf.refuse_unsupported(body)
        body = dict(body)
        body["_ignored"] = rf.unknown_fields(body, known)
        return body

    def _build(
        self,
        kind: str,
        body: dict,
        prompts: list[list[int]],
        max_tokens: int,
        logprobs: int | None,
        tools: list | None = None,
        tool_choice: Any = None,
    ) -> ParsedRequest:
        # Checks run in a fixed order so a body with several mistakes always names the same one.
        n = rf.count(body, "n", 1, 1, rf.MAX_N)
        sampling = self._sampling_fields(body)
        structured = self._structured(body, tools, tool_choice)
        stop = self._stop_strings(body.get("stop"))
        stream, include_usage = self._stream_flags(body)
        prompt_logprobs = rf.count(body, "prompt_logprobs", None, 0, rf.MAX_LOGPROBS)
        parsed = ParsedRequest(
            kind=kind,
            model=self.served_model_name,
            prompt_ids=prompts[0],
            sampling=SamplingParams(
                max_tokens=max_tokens,
                n=n,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured=structured,
                **sampling,
            ),
            stop=stop,
            stream=stream,
            include_usage=include_usage,
            prompts=prompts,
            n=n,
            logprobs=logprobs,
            include_stop_str=rf.optional_bool(body, "include_stop_str_in_output", False),
            skip_special_tokens=rf.optional_bool(body, "skip_special_tokens", True),
            tools=tools,
            tool_choice=tool_choice,
            tool_format=self.tool_format if tools and tool_choice == "auto" else None,
            ignored_fields=body["_ignored"],
        )
        if tools and tool_choice == "auto" and self.tool_format is None:
            raise bad_request(
                "this model's chat template has no tool-call format tandem can parse; use "
                "tool_choice 'required' or a named function",
                "tool_choice",
            )
        return parsed

    def _structured(self, body: dict, tools, tool_choice) -> tuple[str, str] | None:
        from router.tools import tool_choice_constraint

        spec, param = rf.structured_spec(body)
        forced = tool_choice_constraint(tools, tool_choice) if tools else None
        if spec is not None and forced is not None:
            raise bad_request(
                "a forced tool_choice cannot be combined with another structured output constraint",
                "tool_choice",
            )
        if spec is None:
            spec, param = forced, "tools"
        if spec is not None and self.check_structured is not None:
            try:
                self.check_structured(*spec)
            except ValueError as e:
                raise bad_request(f"invalid structured output constraint: {e}", param) from e
        return spec

    def _sampling_fields(self, body: dict) -> dict[str, Any]:
        """The validated SamplingParams fields other than max_tokens, n and logprobs."""
        d = self.defaults
        temperature = rf.number(body, "temperature", d.get("temperature", 1.0), 0, 1e6)
        top_p = rf.number(body, "top_p", d.get("top_p", 1.0), 0, 1, lo_open=True)
        top_k = body.get("top_k")
        if top_k is None:
            top_k = d.get("top_k", -1)
        if not _is_int(top_k):  # before the == 0 below, which false would pass
            raise bad_request(f"top_k must be -1, 0 or a positive int, got {top_k!r}", "top_k")
        if top_k == 0:
            top_k = -1  # vLLM: 0 and -1 both mean "no top-k"
        if not _is_int(top_k) or top_k < -1:
            raise bad_request(f"top_k must be -1, 0 or a positive int, got {top_k!r}", "top_k")
        seed = body.get("seed")
        if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
            raise bad_request(f"seed must be a 64-bit int, got {seed!r}", "seed")
        stop_token_ids = body.get("stop_token_ids")
        if stop_token_ids is None:
            stop_token_ids = []
        if not isinstance(stop_token_ids, list):
            raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
        self._check_token_ids(stop_token_ids, "stop_token_ids")
        return {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "stop_token_ids": tuple(stop_token_ids),
            "ignore_eos": rf.optional_bool(body, "ignore_eos", False),
            "min_tokens": rf.count(body, "min_tokens", 0, 0, self.max_model_len),
            "presence_penalty": rf.number(body, "presence_penalty", 0.0, -2, 2),
            "frequency_penalty": rf.number(body, "frequency_penalty", 0.0, -2, 2),
            "repetition_penalty": rf.number(
                body, "repetition_penalty", d.get("repetition_penalty", 1.0), 0, 1e6, True
            ),
            "logit_bias": rf.logit_bias(body, self.vocab_size),
            "min_p": rf.number(body, "min_p", d.get("min_p", 0.0), 0, 1),
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

    def _completion_prompts(self, prompt: Any, add_special: bool) -> list[list[int]]:
        """A string, a list of token ids, or a list of either (a batch, one choice set each)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            if len(prompt) > rf.MAX_N:
                raise bad_request(f"at most {rf.MAX_N} prompts per request", "prompt")
            return [self._one_prompt(p, add_special) for p in prompt]
        return [self._one_prompt(prompt, add_special)]

    def _one_prompt(self, prompt: Any, add_special: bool) -> list[int]:
        if isinstance(prompt, list):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt", code="empty_prompt")
            self._check_token_ids(prompt, "prompt")
            return list(prompt)
        if not isinstance(prompt, str):
            raise bad_request(
                "prompt must be a string, a list of token ids, or a list of either", "prompt"
            )
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt", code="empty_prompt")
        ids = self._tokenize(prompt, "prompt", add_special_tokens=add_special)
        if not ids:
            raise bad_request("prompt tokenizes to no tokens", "prompt", code="empty_prompt")
        return ids

    def _chat_messages(self, messages: Any) -> list[dict]:
        if not isinstance(messages, list):
            raise bad_request("messages must be a list of message objects", "messages")
        if not messages:
            raise bad_request("messages must not be empty", "messages", code="empty_prompt")
        return [self._chat_message(msg, i) for i, msg in enumerate(messages)]

    def _chat_message(self, msg: Any, i: int) -> dict:
        if not isinstance(msg, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        extra = sorted(set(msg) - MESSAGE_FIELDS)
        if extra:
            raise bad_request(f"messages[{i}] has unsupported fields {extra}", "messages")
        role = msg.get("role")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}].role must be a string", "messages")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role {role!r} is not one of {', '.join(CHAT_ROLES)}",
                "messages",
            )
        out = {"role": role, "content": self._message_text(msg.get("content"), i)}
        for name in ("name", "tool_call_id"):
            if msg.get(name) is not None:
                if not isinstance(msg[name], str):
                    raise bad_request(f"messages[{i}].{name} must be a string", "messages")
                out[name] = msg[name]
        if msg.get("tool_calls") is not None:  # [] is none; 0, false, "", {} are refused
            calls = self._message_tool_calls(msg["tool_calls"], i)
            if calls:
                out["tool_calls"] = calls
        return out

    @staticmethod
    def _message_tool_calls(calls: Any, i: int) -> list[dict]:
        """An assistant turn's earlier tool calls, with arguments as objects for the template
        (OpenAI sends them as JSON text)."""
        if not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
        out = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"messages[{i}].tool_calls need function.name", "messages")
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except (ValueError, RecursionError) as e:  # JSONDecodeError, huge ints, depth
                raise bad_request(
                    f"messages[{i}].tool_calls arguments are not JSON: {e}", "messages"
                ) from e
            out.append({**call, "function": {"name": fn["name"], "arguments": args}})
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

    def _apply_chat_template(self, messages: list[dict], body: dict, tools) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                f"model `{self.served_model_name}` has no chat template; use /v1/completions",
                "messages",
                code="no_chat_template",
            )
        cont = rf.optional_bool(body, "continue_final_message", False)
        gen = rf.optional_bool(body, "add_generation_prompt", not cont)
        if cont and gen:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        if cont and messages[-1]["role"] != "assistant":
            raise bad_request(
                "continue_final_message needs the last message to be the assistant's",
                "continue_final_message",
            )
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
        if "chat_template" in kwargs or "tokenize" in kwargs:
            # A template from the request would run a client's Jinja in the router (vLLM
            # refuses it too unless told to trust request templates).
            raise bad_request(
                "chat_template_kwargs may not set 'chat_template' or 'tokenize'",
                "chat_template_kwargs",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=gen,
                continue_final_message=cont,
                **kwargs,
            )
        except Exception as e:  # jinja raises its own errors (e.g. roles must alternate)
            raise bad_request(f"chat template failed: {e}", "messages") from e
        # The template already wrote BOS and the turn markers.
        add_special = rf.optional_bool(body, "add_special_tokens", False)
        ids = self._tokenize(text, "messages", add_special_tokens=add_special)
        if not ids:
            raise bad_request("messages render to an empty prompt", "messages", code="empty_prompt")
        return ids
