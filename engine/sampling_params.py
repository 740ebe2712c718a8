"""Per-request sampling settings, validated on construction.

The router builds one from an OpenAI request, the workers receive it over the wire (see
`engine.protocol`), and the sampler reads it; every field is checked here once so no other
layer has to. Defaults are the identity: a request that sets nothing pays for no logits
processing (engine/logits_processors.py only touches rows with `needs_processing`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs (completions' logprobs is 5; vLLM allows 20)
MAX_N = 128
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_range(name: str, v, lo: float, hi: float, lo_open: bool = False) -> None:
    if not _is_number(v) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if v > hi or v < lo or (lo_open and v == lo):
        lo_b = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {lo_b}{lo}, {hi}], got {v}")


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # Choices sampled from one prompt: the prompt is computed once and its KV blocks shared.
    n: int = 1
    # Top log-probabilities returned per sampled token (0: the sampled token's only); None off.
    logprobs: int | None = None
    # The same for every prompt position (echo / log-likelihood); None off.
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias added to its logit) pairs; a pair list, since msgpack maps need str keys.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_p: float = 0.0
    # (kind, spec): ("json_schema", schema JSON text), ("json_object", ""), ("regex", pattern),
    # ("choice", JSON list of strings), ("grammar", Lark grammar). See engine/structured/.
    structured: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        self._check_basic()
        self._check_extended()

    def _check_basic(self) -> None:
        if not _is_int(self.max_tokens):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not _is_number(self.temperature):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not _is_number(self.top_p):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an int, got {self.top_k!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        ids = tuple(self.stop_token_ids)
        if any(not _is_int(t) or t < 0 for t in ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def _check_extended(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}]")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative int, got {self.min_tokens!r}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 2.0**31, lo_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        bias = tuple(tuple(p) if isinstance(p, list | tuple) else p for p in self.logit_bias)
        for pair in bias:
            if not isinstance(pair, tuple) or len(pair) != 2 or not _is_int(pair[0]):
                raise ValueError(f"logit_bias must hold (token id, bias) pairs, got {pair!r}")
            if pair[0] < 0:
                raise ValueError(f"logit_bias token id must be >= 0, got {pair[0]}")
            _check_range("logit_bias value", pair[1], -100.0, 100.0)
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if self.structured is not None:
            spec = tuple(self.structured)
            if len(spec) != 2 or not all(isinstance(x, str) for x in spec):
                raise ValueError("structured must be a (kind, spec) pair of strings")
            if spec[0] not in STRUCTURED_KINDS:
                raise ValueError(f"structured kind must be one of {STRUCTURED_KINDS}")
            object.__setattr__(self, "structured", spec)

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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(p) for p in self.logit_bias]
        d["structured"] = None if self.structured is None else list(self.structured)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        if not isinstance(d, dict):
            raise ValueError(f"sampling params must be a mapping, got {type(d).__name__}")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling fields: {sorted(unknown)}")
        d = dict(d)
        for name in ("stop_token_ids", "logit_bias"):
            if name in d:
                if not isinstance(d[name], list | tuple):
                    raise ValueError(f"{name} must be a list")
                d[name] = tuple(d[name])
        if d.get("structured") is not None:
            if not isinstance(d["structured"], list | tuple):
                raise ValueError("structured must be a list")
            d["structured"] = tuple(d["structured"])
        return cls(**d)
