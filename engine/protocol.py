"""Messages between the router and the workers (ZMQ, encoded by `engine.wire`).

Request path: the router sends `PrefillRequest` to a prefill worker (disaggregated) or
`GenerateRequest` to a decode worker (local prefill). Every worker streams `TokenMessage`s to
the router's `reply_to` endpoint; each carries the request id and the output index of its first
token so the router can merge the first token (from prefill) with the rest (from decode).
A `TokenMessage` is also what the engine's step returns (`engine.outputs.TokenOutput` is this
class): the engine server fills in the worker fields and sends that same record.
`AbortRequest` goes to whichever worker may hold the request. The KV hand-off messages between
prefill and decode workers live in `kv_transfer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from msgspec import Meta

from engine.sampling_params import MAX_LOGPROBS, SamplingParams, TokenId
from engine.wire import Frame, message

MAX_IDS = 1 << 20  # token or block ids in one message: a 1M-token prompt fits
Name = Annotated[str, Meta(min_length=1, max_length=256)]  # request and worker ids
RequestId = Name
Endpoint = Annotated[str, Meta(min_length=1, max_length=256, pattern="://")]  # a ZMQ endpoint
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_IDS)]
PromptIds = Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_IDS)]
Count = Annotated[int, Meta(ge=0)]
# (logprob, rank (1: the most likely), [(token id, logprob), ...top]): engine.sampler's entry.
TopLogprobs = Annotated[list[tuple[TokenId, float]], Meta(max_length=MAX_LOGPROBS)]
LogprobEntry = tuple[float, Annotated[int, Meta(ge=1)], TopLogprobs]


class _Request(Frame):
    """Fields every request to a worker carries."""

    request_id: RequestId
    prompt_token_ids: PromptIds
    sampling: SamplingParams
    reply_to: Endpoint  # ZMQ endpoint of the router's token sink


@message("generate")
class GenerateRequest(_Request):
    """Whole request for one worker: prefill and decode both run there (local prefill)."""


@message("prefill")
class PrefillRequest(_Request):
    """Prefill on a prefill worker, then hand the KV to `decode_worker_id`."""

    decode_worker_id: Name
    decode_endpoint: Endpoint  # where the prefill worker sends the KV hand-off


@message("tokens")
class TokenMessage(Frame):
    """New tokens of one choice of one request from one engine step.

    `index` is the position in the output of `token_ids[0]`; the router reorders by it because
    the first token (from prefill) and the rest (from decode) arrive on different sockets.
    `logprobs` (when asked) holds one entry per token; `prompt_logprobs` comes with the first
    token (index 0) of choice 0 when asked (its first entry is None: nothing predicts it).
    """

    # The engine fills these (positionally, in this order), the engine server the rest.
    request_id: RequestId
    index: Count
    token_ids: TokenIds
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    choice: Count = 0  # which of the request's n choices
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    num_cached_tokens: Count = 0  # prefix-cache hits at admission
    error: str | None = None
    worker_id: str = ""
    prefill_worker_id: str = ""  # set on the first token: where the prefill ran
    # From a decode worker, no tokens: "I took this request over from its prefill worker"
    # (its KV hand-off is queued here; a lost prefill worker is now this worker's business).
    handoff: bool = False

    def check(self) -> None:
        if self.handoff and (self.token_ids or self.finish_reason is not None):
            raise ValueError("a handoff message carries no tokens and no finish_reason")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError("logprobs must hold one entry per token")


@message("abort")
class AbortRequest(Frame):
    request_id: RequestId
    reason: str = "client disconnected"


@message("shutdown")
class Shutdown(Frame):
    reason: str = ""


@dataclass(slots=True)
class WorkerLoad:
    """A worker's load as the router's policies see it (reported through the controller)."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    extra: dict = field(default_factory=dict)
