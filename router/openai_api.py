"""OpenAI request bodies -> `ParsedRequest` (or an `APIError` 4xx), in three steps.

0. `read_body` reads the bytes, refusing every way they can be hostile before parsing:
   too slow (a slow-loris client dribbling bytes): 408 once `timeout_s` passes; over the app's
   size limit: aiohttp's 413 (the error middleware words it); a lone UTF-16 surrogate in any
   string (valid JSON, `"\\ud800"`, but not text a tokenizer or a response can carry): 400
   `invalid_unicode` naming where it is. The model's JSON parser then refuses what is not JSON,
   not UTF-8, or nested too deep (400 `invalid_json`).
1. The body's bytes are validated by its model (router/protocol.py: types, bounds, token ids,
   the rules across fields; `protocol.api_error` picks the one error a client is told).
2. `RequestParser` converts the model with what only the served model knows: the tokenizer
   and chat template, the context window, generation_config.json's sampling defaults
   (temperature, top_p, top_k, min_p, repetition_penalty, as vLLM applies them, then OpenAI's),
   and the structured-output compiler. Every check that can fail on client input happens in
   these steps, so a bad request costs no worker time and never surfaces as a 5xx.

`max_tokens` (as vLLM): absent -> 16 for /v1/completions (OpenAI's legacy default), capped by the
room left in the window; for /v1/chat/completions the whole room left. An explicit value must
fit in the window with the prompt; chat's `max_completion_tokens` wins over `max_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from engine.protocol import MAX_BAD_WORD_TOKENS, SamplingParams
from router import generic_tools, openai_fields
from router.completion_protocol import CompletionRequest
from router.errors import APIError, api_error, bad_request
from router.openai_fields import ACCEPTED
from router.protocol import ChatCompletionRequest, Limits
from router.reasoning import initial_mode, think_token_ids
from router.tools import MISTRAL_CALLS, auto_tools_grammar, with_mistral_call_ids

log = logging.getLogger(__name__)
_warned: set[str] = set()  # unknown field names already logged


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams  # what the engine runs (its n is best_of when that is larger)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage on every chunk
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
    parallel_tool_calls: bool = True  # False: at most one call is returned
    # "auto" calls constrained by router/tools.py auto_tools_grammar: a call the model opens is
    # valid, so its arguments stream as they come and a cut one is returned.
    tool_grammar: bool = False
    # The stop token's text is not part of the answer (vLLM's rule): set where tandem itself
    # turned skip_special_tokens off to read a call marker that is a special token.
    hide_stop_token: bool = False
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs say `token_id:<id>`
    return_token_ids: bool = False  # vLLM's: prompt and answer token ids beside the text
    request_id: str | None = None  # vLLM's: the answer's id after its prefix (router/responses.py)
    # Where a reasoning model's answer starts (router/reasoning.py); None: no thinking split.
    reasoning_mode: str | None = None
    ignored_fields: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompts:
            self.prompts = [self.prompt_ids]


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The body's bytes, read within `timeout_s` and free of lone surrogates."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError as e:
        raise APIError(
            408, f"the request body did not arrive within {timeout_s:g}s", code="body_timeout"
        ) from e
    # Valid UTF-8 cannot hold a surrogate: only a \uD800-\uDFFF escape makes one, so only a
    # body with such an escape is parsed here and walked (a paired one is fine, and found fine;
    # a body that is not JSON is left to the model's parser to refuse).
    if not _SURROGATE_ESCAPE.search(raw):
        return raw
    try:
        where = surrogate_path(json.loads(raw))
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, digits
        return raw
    if where is not None:
        raise APIError(
            400,
            f"{where} holds a lone UTF-16 surrogate, which is not valid text",
            param=where.split("[")[0].split(".")[0] or None,
            code="invalid_unicode",
        )
    return raw


def surrogate_path(value: Any) -> str | None:
    """Where the first string (or object key) holding a lone surrogate is, as `a.b[2]`, or
    None. Iterative: a deeply nested body must not exhaust the stack here."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return path or "the body"
        elif isinstance(v, dict):
            for k, sub in v.items():
                key_path = f"{path}.{k}" if path else str(k)
                if not _encodable(k):
                    return path or "a field name"
                stack.append((key_path, sub))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", sub) for i, sub in enumerate(v))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate(model: type, body: bytes | dict, limits: Limits) -> Any:
    """`body` (request bytes, or an already parsed dict) as `model`, or the APIError."""
    try:
        if isinstance(body, bytes | str):
            return model.model_validate_json(body, context=limits)
        return model.model_validate(body, context=limits)
    except ValidationError as e:
        raise api_error(e) from None


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
        model_aliases: tuple[str, ...] = (),
        scheduling_policy: str = "fcfs",
        reasoning_parser: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser
        self.think_ids = (None, None)  # the <think> and </think> tokens (auto tools' grammar)
        if reasoning_parser is not None:
            self.think_ids = think_token_ids(tokenizer, reasoning_parser)
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.limits = Limits(served_model_name, vocab_size, max_model_len, model_aliases)
        self.completion_default_max_tokens = completion_default_max_tokens
        self.defaults = dict(generation_defaults or {})
        # Compiles a structured-output spec (raises ValueError naming the problem) so a bad
        # schema is a 400 here, not an error from a worker.
        self.check_structured = check_structured
        self.tool_format = tool_format
        self.by_priority = scheduling_policy == "priority"
        # Mistral's call marker as one token id for the grammar; special: decoded only with
        # skip_special_tokens off (then the request keeps special tokens to see it).
        self.marker_token, self.marker_special = _single_token(tokenizer, MISTRAL_CALLS)
        # No token covers more characters than its longest vocabulary string, so text longer
        # than this cannot fit in the window: refuse it without paying to tokenize it.
        try:
            longest = max(len(t) for t in tokenizer.get_vocab())
        except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: no shortcut
            longest = 0
        self.max_prompt_chars = 2 * max_model_len * longest if longest else None

    def parse_completion(self, body: bytes | dict) -> ParsedRequest:
        req: CompletionRequest = validate(CompletionRequest, body, self.limits)
        prompts = [
            self._truncated(req, p if isinstance(p, list) else self._tokenize_prompt(req, p))
            for p in req.prompt
        ]
        echo_only = bool(req.echo) and req.max_tokens == 0
        longest = max(len(p) for p in prompts)
        max_tokens = self._max_tokens(
            req, () if echo_only else ("max_tokens",), longest, self.completion_default_max_tokens
        )
        engine: dict[str, Any] = {}
        if req.best_of is not None and req.best_of > req.n:
            # Sample best_of, answer the n with the highest cumulative logprob (every choice
            # reports its logprobs to rank them).
            engine = {"n": req.best_of, "logprobs": req.logprobs or 0}
        if req.echo and req.logprobs is not None:
            engine["prompt_logprobs"] = req.logprobs
        parsed = self._build("completion", req, prompts, max_tokens, req.logprobs, engine)
        parsed.echo, parsed.echo_only = bool(req.echo), echo_only
        return parsed

    def parse_chat(self, body: bytes | dict) -> ParsedRequest:
        req: ChatCompletionRequest = validate(ChatCompletionRequest, body, self.limits)
        prompt_ids = self._truncated(req, self._render(req))
        names = ("max_completion_tokens", "max_tokens")
        max_tokens = self._max_tokens(req, names, len(prompt_ids), None)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        thinking = self._thinking(req, prompt_ids)
        parsed = self._build("chat", req, [prompt_ids], max_tokens, logprobs, thinking=thinking)
        if req.echo and req.messages[-1].role == "assistant":
            parsed.extra["echo_text"] = req.messages[-1].text()
        if req.documents and "documents" not in str(self.tokenizer.chat_template):
            parsed.ignored_fields.append("documents")  # this model's template never reads them
        if parsed.sampling.structured is None or parsed.tool_grammar:
            # Other constraints hold from the first token: no thinking (auto tools' grammar
            # lets the model think first).
            parsed.reasoning_mode = thinking
        return parsed

    def _thinking(self, req: ChatCompletionRequest, prompt_ids: list[int]) -> str | None:
        """Where a reasoning model's answer to `prompt_ids` starts (router/reasoning.py)."""
        if self.reasoning_parser is None:
            return None
        enabled = (req.chat_template_kwargs or {}).get("enable_thinking", True) is not False
        tail = self.tokenizer.decode(prompt_ids[-8:])
        return initial_mode(self.reasoning_parser, tail, enabled)

    def chat_prompt_ids(self, body: dict) -> list[int]:
        """The prompt a chat body renders to (for /tokenize)."""
        return self._render(validate(ChatCompletionRequest, body, self.limits))

    # ------------------------------------------------------------------ conversion

    def _build(
        self,
        kind: str,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int,
        logprobs: int | None,
        engine: dict[str, Any] | None = None,
        thinking: str | None = None,
    ) -> ParsedRequest:
        """`engine`: SamplingParams fields where the engine runs other than the answer shows;
        `thinking`: where a reasoning model's answer starts (its auto tools' grammar)."""
        tools = getattr(req, "_tools", None)
        choice = getattr(req, "_tool_choice", None)
        auto = bool(tools) and choice == "auto"
        structured = self._structured(req, auto, thinking)
        see_marker = auto and self.tool_format == "mistral" and self.marker_special
        sampling = SamplingParams(
            max_tokens=max_tokens,
            structured=structured,
            **self._sampling_fields(req),
            **{"n": req.n, "logprobs": logprobs, "prompt_logprobs": req.prompt_logprobs}
            | (engine or {}),
        )
        stream = bool(req.stream)
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        stop = req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else []
        return ParsedRequest(
            kind=kind,
            model=self.served_model_name,
            prompt_ids=prompts[0],
            sampling=sampling,
            stop=tuple(dict.fromkeys(stop)),
            stream=stream,
            include_usage=include_usage,
            continuous_usage=include_usage and bool(options.continuous_usage_stats),
            prompts=prompts,
            n=req.n,
            logprobs=logprobs,
            include_stop_str=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False and not see_marker,
            hide_stop_token=see_marker,
            tools=tools,
            tool_choice=choice,
            tool_format=(self.tool_format or generic_tools.FORMAT) if auto else None,
            parallel_tool_calls=getattr(req, "parallel_tool_calls", None) is not False,
            tool_grammar=auto and structured is not None and req._structured is None,
            tokens_as_ids=bool(req.return_tokens_as_token_ids),
            return_token_ids=bool(req.return_token_ids),
            request_id=req.request_id,
            ignored_fields=_ignored(req),
        )

    def _structured(
        self, req: Any, auto_tools: bool, thinking: str | None = None
    ) -> tuple[str, str] | None:
        if req._structured is not None:
            param, spec = req._structured
        elif auto_tools:
            # Text, or only calls the parser reads (router/tools.py auto_tools_grammar).
            parallel = getattr(req, "parallel_tool_calls", None) is not False
            fmt = self.tool_format or generic_tools.FORMAT
            grammar = auto_tools_grammar(
                req._tools, fmt, parallel, self.marker_token, thinking, self.think_ids
            )
            param, spec = "tools", ("grammar", grammar)
        else:
            return None
        if self.check_structured is not None:
            try:
                self.check_structured(*spec)
            except ValueError as e:
                raise bad_request(f"invalid structured output constraint: {e}", param) from e
        return spec

    def _sampling_fields(self, req: Any) -> dict[str, Any]:
        """SamplingParams fields other than max_tokens, n, logprobs and structured."""
        d = self.defaults

        def pick(name: str, default: Any) -> Any:
            value = getattr(req, name)
            return d.get(name, default) if value is None else value

        top_k = pick("top_k", -1)
        return {
            "temperature": float(pick("temperature", 1.0)),
            "top_p": float(pick("top_p", 1.0)),
            "top_k": -1 if top_k == 0 else top_k,  # vLLM: 0 and -1 both mean "no top-k"
            "min_p": float(pick("min_p", 0.0)),
            "repetition_penalty": float(pick("repetition_penalty", 1.0)),
            "seed": req.seed,
            "stop_token_ids": tuple(req.stop_token_ids or ()),
            "ignore_eos": bool(req.ignore_eos),
            "min_tokens": req.min_tokens or 0,
            "presence_penalty": req.presence_penalty or 0.0,
            "frequency_penalty": req.frequency_penalty or 0.0,
            "logit_bias": tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items()),
            "allowed_token_ids": tuple(req.allowed_token_ids or ()),
            "bad_words_token_ids": self._bad_words(req.bad_words or ()),
            "cache_salt": req.cache_salt,
            "priority": self._priority(req.priority or 0),
        }

    def _priority(self, priority: int) -> int:
        if priority and not self.by_priority:
            raise bad_request(openai_fields.PRIORITY_NEEDS_POLICY, "priority", "unsupported_field")
        return priority

    def _bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad words as token ids: each word as the tokenizer splits it alone, and after
        a space (the word mid-text) where that gives another first token and as many tokens."""
        out: list[tuple[int, ...]] = []
        for i, word in enumerate(words):
            bare, spaced = (
                tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                for text in (word.lstrip(), " " + word.lstrip())
            )
            if len(bare) > MAX_BAD_WORD_TOKENS:
                message = f"bad_words[{i}] is {len(bare)} tokens, over {MAX_BAD_WORD_TOKENS}"
                raise bad_request(message, "bad_words")
            out += [bare] if bare else []
            if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return tuple(dict.fromkeys(out))

    def _tokenize_prompt(self, req: Any, text: str) -> list[int]:
        # Truncated, a text of any length is served: no shortcut refuses it untokenized.
        long_ok = req.truncate_prompt_tokens is not None
        return self._tokenize(text, "prompt", req.add_special_tokens is not False, long_ok)

    def _truncated(self, req: Any, ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the window's worth)."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return list(ids)
        return list(ids[-(self.max_model_len if keep == -1 else keep) :])

    def _max_tokens(
        self, req: Any, names: tuple[str, ...], prompt_len: int, default_cap: int | None
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
            value = getattr(req, name)
            if value is None:
                continue
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

    # ------------------------------------------------------------------ prompts

    def _tokenize(
        self, text: str, param: str, add_special_tokens: bool, long_ok: bool = False
    ) -> list[int]:
        if not long_ok and self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens, and "
                f"the {param} ({len(text)} characters) is far longer than that.",
                param,
                code="context_length_exceeded",
            )
        ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        if not ids:
            empty = {"prompt": "prompt tokenizes to no tokens"}
            message = empty.get(param, "messages render to an empty prompt")
            raise bad_request(message, param, code="empty_prompt")
        return ids

    def _render(self, req: ChatCompletionRequest) -> list[int]:
        """The chat template's output for the request's messages and tools, tokenized."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                f"model `{self.served_model_name}` has no chat template; use /v1/completions",
                "messages",
                code="no_chat_template",
            )
        cont = bool(req.continue_final_message)
        gen = not cont if req.add_generation_prompt is None else req.add_generation_prompt
        try:
            messages, tools = [m.for_template() for m in req.messages], req._tools
            if tools and self.tool_format is None and req._tool_choice == "auto":
                # The template cannot show the tools: router/generic_tools.py does.
                messages, tools = generic_tools.messages_with_tools(messages, tools), None
            elif self.tool_format == "mistral":  # its templates take only 9-character ids
                messages = with_mistral_call_ids(messages)
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=gen,
                continue_final_message=cont,
                **({"documents": req.documents} if req.documents else {}),
                **(req.chat_template_kwargs or {}),
            )
        except Exception as e:  # jinja raises its own errors (e.g. roles must alternate)
            raise bad_request(f"chat template failed: {e}", "messages") from e
        # The template already wrote BOS and the turn markers.
        long_ok = req.truncate_prompt_tokens is not None
        return self._tokenize(text, "messages", bool(req.add_special_tokens), long_ok)


def _single_token(tokenizer: Any, text: str) -> tuple[int | None, bool]:
    """(id, special) of the one token `text` is in the vocabulary, or (None, False)."""
    try:
        token_id = tokenizer.get_vocab().get(text)
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: the text is matched
        return None, False
    if token_id is None:
        return None, False
    # The Rust decode skips added tokens marked special (Mistral's control tokens are, without
    # being listed in additional_special_tokens).
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token_id)
    special = bool(getattr(added, "special", False))
    return token_id, special or text in getattr(tokenizer, "all_special_tokens", ())


def _ignored(req: Any) -> list[str]:
    """The set fields that have no effect, as `X-Tandem-Ignored-Fields` names them: OpenAI
    fields tandem accepts without acting on, unknown top-level fields, unused message fields.
    An OpenAI field tandem cannot serve is a 400. Each name is logged once."""
    out = []
    for name, value in sorted((req.model_extra or {}).items()):
        why = openai_fields.refusal(name, value)
        if why is not None:
            raise bad_request(why, name, code="unsupported_field")
        if name in openai_fields.REFUSED_UNLESS or (
            value is None and name in openai_fields.ACCEPTED
        ):
            continue  # left empty: nothing was asked for
        out.append(name)
        if name not in _warned and len(_warned) < 1024:
            _warned.add(name)
            if name in ACCEPTED:
                reason = ACCEPTED[name]
                log.info("OpenAI field %r accepted without effect: %s", name, reason)
            else:
                log.warning("ignoring unknown request field %r (not an OpenAI or vLLM field)", name)
    if isinstance(req, ChatCompletionRequest):  # elsewhere "messages" is an unknown field
        out += openai_fields.message_fields(req.messages)
    out += [name for name in getattr(req, "NOT_USED", ()) if getattr(req, name) is not None]
    return out + openai_fields.nested_fields(req)
