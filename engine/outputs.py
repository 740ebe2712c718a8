"""What the engine hands back: whole results for offline `LLM.generate`, and the per-step token
increments that the serving path streams: one `TokenOutput` per request choice per step, which
is the wire record itself (`engine.protocol.TokenMessage`), so the engine server only fills in
where it ran and sends it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.protocol import TokenMessage

TokenOutput = TokenMessage  # the engine's name for it: request_id, index, token_ids, ...


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
