"""What the engine hands back: whole results for offline `LLM.generate`, and the per-step token
increments that the serving path streams (one `TokenOutput` per request per step)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenOutput:
    """New tokens of one request from one engine step.

    `index` is the position in the output of `token_ids[0]`; the router reorders by it because
    the first token (from prefill) and the rest (from decode) arrive on different sockets.
    `finish_reason` is None while the request runs, else "stop", "length" or "abort".
    `choice` is which of the request's n choices the tokens belong to. `logprobs` (when asked)
    holds one `(logprob, rank, [(token id, logprob), ...top])` per token; `prompt_logprobs`
    comes with the first token (index 0) of choice 0 when asked.
    """

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    choice: int = 0
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    ttft: float | None = None  # seconds from arrival to first token
    tpot: float | None = None  # mean seconds per output token after the first
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    logprobs: list | None = None  # per output token, as TokenOutput.logprobs
    prompt_logprobs: list | None = None
    cumulative_logprob: float = 0.0
    # n > 1: every choice, in order (choices[0] is this output's own tokens).
    choices: list[RequestOutput] = field(default_factory=list)
