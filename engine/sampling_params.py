"""Per-request sampling settings, and every bound on them (the router imports these).

Lifecycle: the router builds one from an OpenAI request (checked once, in `__post_init__`), it
travels inside a request frame (`engine.protocol`) and the worker's decoder checks it against the
same field annotations (`engine.wire`: checked once there too, not again after decoding); the
sampler then trusts it. Defaults are the identity: a request that sets nothing pays for no logits
processing (engine/sampler.py's logits processors only touch rows with `needs_processing`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from engine.wire import Frame

MAX_N = 128  # choices per request
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs (completions' logprobs is 5; vLLM allows 20)
TEMPERATURE_MAX = 1e6
TOP_K_DISABLED = -1
REPETITION_PENALTY_MAX = 1e6  # (0, max]: 1 is off
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS_ENTRIES = 300
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
GREEDY_BELOW_TEMPERATURE = 1e-5

TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
Penalty = Annotated[float, Meta(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]
LogprobCount = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
LogitBias = tuple[TokenId, Annotated[float, Meta(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]]


class SamplingParams(Frame, frozen=True):
    max_tokens: Annotated[int, Meta(ge=1)] = 16
    temperature: Annotated[float, Meta(ge=0.0, le=TEMPERATURE_MAX)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=TOP_K_DISABLED)] = TOP_K_DISABLED  # 0 is refused in check()
    seed: Annotated[int, Meta(ge=SEED_RANGE[0])] | None = None  # the top: check() (over int64)
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: bool = False
    # Choices sampled from one prompt: the prompt is computed once and its KV blocks shared.
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    # Top log-probabilities returned per sampled token (0: the sampled token's only); None off.
    logprobs: LogprobCount | None = None
    # The same for every prompt position (echo / log-likelihood); None off.
    prompt_logprobs: LogprobCount | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0  # EOS and stop_token_ids masked until this many
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=REPETITION_PENALTY_MAX)] = 1.0
    # (token id, bias added to its logit) pairs; a pair list, since msgpack maps need str keys.
    logit_bias: Annotated[tuple[LogitBias, ...], Meta(max_length=MAX_LOGIT_BIAS_ENTRIES)] = ()
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    # (kind, spec): ("json_schema", schema JSON text), ("json_object", ""), ("regex", pattern),
    # ("choice", JSON list of strings), ("grammar", Lark grammar). See engine/structured/.
    structured: tuple[Literal[STRUCTURED_KINDS], str] | None = None

    def check(self) -> None:
        if self.top_k == 0:
            raise ValueError(f"top_k must be {TOP_K_DISABLED} (disabled) or >= 1, got 0")
        if self.seed is not None and self.seed > SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")

    @property
    def greedy(self) -> bool:
        # As vLLM: a temperature this small is greedy (dividing logits by 1e-300 overflows).
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processor changes this request's logits (engine hot path)."""
        return bool(
            self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )
