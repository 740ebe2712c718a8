"""Messages between the router and the workers (ZMQ, encoded by `engine.wire`).

Request path: the router sends `PrefillRequest` to a prefill worker (disaggregated) or
`GenerateRequest` to a decode worker (local prefill). Every worker streams `TokenMessage`s to
the router's `reply_to` endpoint; each carries the request id and the output index of its first
token so the router can merge the first token (from prefill) with the rest (from decode).
`AbortRequest` goes to whichever worker may hold the request. The KV hand-off messages between
prefill and decode workers live in `kv_transfer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.wire import message


def _check_ids(name: str, ids: list[int]) -> None:
    if not isinstance(ids, list) or any(
        isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids
    ):
        raise ValueError(f"{name} must be a list of non-negative ints")


def _check_rid(rid: str) -> None:
    if not isinstance(rid, str) or not rid or len(rid) > 256:
        raise ValueError("request_id must be a non-empty string of at most 256 chars")


def _check_request(msg) -> None:
    """Fields every request to a worker carries."""
    _check_rid(msg.request_id)
    _check_ids("prompt_token_ids", msg.prompt_token_ids)
    if not msg.prompt_token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    if not isinstance(msg.sampling, SamplingParams):
        raise ValueError("sampling must be SamplingParams")
    if not isinstance(msg.reply_to, str) or "://" not in msg.reply_to:
        raise ValueError("reply_to must be a ZMQ endpoint")


@message("generate")
@dataclass(slots=True)
class GenerateRequest:
    """Whole request for one worker: prefill and decode both run there (local prefill)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str  # ZMQ endpoint of the router's token sink

    def __post_init__(self) -> None:
        _check_request(self)


@message("prefill")
@dataclass(slots=True)
class PrefillRequest:
    """Prefill on a prefill worker, then hand the KV to `decode_worker_id`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    decode_worker_id: str
    decode_endpoint: str  # where the prefill worker sends the KV hand-off

    def __post_init__(self) -> None:
        _check_request(self)


def _check_logprob_entry(name: str, entry) -> None:
    """[logprob, rank, [[token id, logprob], ...]] (engine.sampler.token_logprobs)."""
    if not isinstance(entry, list | tuple) or len(entry) != 3:
        raise ValueError(f"{name} entries must be [logprob, rank, top]")
    lp, rank, top = entry
    if isinstance(lp, bool) or not isinstance(lp, int | float):
        raise ValueError(f"{name}: logprob must be a number")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{name}: rank must be a positive int")
    if not isinstance(top, list) or len(top) > MAX_TOP_LOGPROBS:
        raise ValueError(f"{name}: top must be a list of at most {MAX_TOP_LOGPROBS}")
    for pair in top:
        if not isinstance(pair, list | tuple) or len(pair) != 2 or isinstance(pair[0], bool):
            raise ValueError(f"{name}: top entries must be [token id, logprob]")


MAX_TOP_LOGPROBS = 20


@message("tokens")
@dataclass(slots=True)
class TokenMessage:
    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    worker_id: str = ""
    prefill_worker_id: str = ""  # set on the first token: where the prefill ran
    num_cached_tokens: int = 0
    choice: int = 0  # which of the request's n choices
    logprobs: list | None = None  # one entry per token in token_ids, when asked
    prompt_logprobs: list | None = None  # with index 0 of choice 0, when asked (first is None)
    # From a decode worker, no tokens: "I took this request over from its prefill worker"
    # (its KV hand-off is queued here; a lost prefill worker is now this worker's business).
    handoff: bool = False

    def __post_init__(self) -> None:
        _check_rid(self.request_id)
        _check_ids("token_ids", self.token_ids)
        if not isinstance(self.handoff, bool):
            raise ValueError("handoff must be a bool")
        if self.handoff and (self.token_ids or self.finish_reason is not None):
            raise ValueError("a handoff message carries no tokens and no finish_reason")
        for name in ("index", "choice", "num_cached_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int")
        if self.finish_reason not in (None, "stop", "length", "abort", "error"):
            raise ValueError(f"bad finish_reason {self.finish_reason!r}")
        if self.logprobs is not None:
            if not isinstance(self.logprobs, list) or len(self.logprobs) != len(self.token_ids):
                raise ValueError("logprobs must hold one entry per token")
            for entry in self.logprobs:
                _check_logprob_entry("logprobs", entry)
        if self.prompt_logprobs is not None:
            if not isinstance(self.prompt_logprobs, list):
                raise ValueError("prompt_logprobs must be a list")
            for entry in self.prompt_logprobs[1:]:
                _check_logprob_entry("prompt_logprobs", entry)


@message("abort")
@dataclass(slots=True)
class AbortRequest:
    request_id: str
    reason: str = "client disconnected"

    def __post_init__(self) -> None:
        _check_rid(self.request_id)


@message("shutdown")
@dataclass(slots=True)
class Shutdown:
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
