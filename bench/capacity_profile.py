"""`CapacityProfile`: what one worker of a given model on given hardware can do, as the planner
and the simulator read it. Written by `tandem profile --capacity` (measured on the machine at
hand, bench/capacity.py) or by `tandem plan` (a roofline model of hardware not at hand,
cluster/planner/roofline.py); read by cluster/planner and cluster/simulator.

The cost model (one engine step of one worker):

    prefill step  = prefill_s(batch prompt tokens)       piecewise linear in the measured points
    decode step   = decode_fixed_s + decode_per_seq_s * batch + decode_per_ctx_token_s * context
    mixed step    = prefill_s(tokens) + decode step - decode_fixed_s (weights are read once)
    KV hand-off   = transfer_latency_s + tokens * kv_bytes_per_token / transfer_bytes_per_s

where `context` is the sum of the context lengths of the batch's sequences (the KV the step
reads). The decode form is the roofline's: weights read once per step, a per-sequence cost
(sampling, activations) and a KV read that grows with every token of context.
`request_overhead_s` is what a request pays outside the engine before its first token (router,
dispatch, sockets), `token_overhead_s` what each later token pays on its way to the client.

A worker may be a tensor-parallel group: `gpus_per_worker` is its TP size (`tandem profile
--capacity --tp N`, `tandem plan --tp N`), and every figure is of the whole N-GPU worker. The
planner counts a pool's GPUs as its workers x that pool's TP size (cluster/planner/config.py).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

SOURCES = ("measured", "roofline")


@dataclass(slots=True)
class CapacityProfile:
    model: str
    hardware: str
    source: str
    # (batch prompt tokens, seconds of the step that computes them), ascending in tokens.
    prefill_points: list[tuple[int, float]]
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    kv_bytes_per_token: int
    transfer_latency_s: float
    transfer_bytes_per_s: float
    kv_capacity_tokens: int  # KV cache of one worker, in tokens
    max_batch_tokens: int  # token budget of one step
    max_num_seqs: int  # sequences one step may hold
    startup_s: float  # a new worker's time from start to serving
    gpus_per_worker: int = 1
    request_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    # Seconds per squared prompt token of causal attention in a prefill step (q of
    # prefill_s(n) ~ a + b*n + q*n^2). A roofline knows it; None: fitted from the points
    # (bench/prefill_cost.py), as for a measured profile.
    prefill_attention_s: float | None = None
    # Raw measurements and fit quality, for reports; never read by the model.
    measurements: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        points = sorted((int(t), float(s)) for t, s in self.prefill_points)
        if not points or any(t < 1 or not (s > 0 and math.isfinite(s)) for t, s in points):
            raise ValueError(f"prefill_points need tokens >= 1 and seconds > 0: {points}")
        if len({t for t, _ in points}) != len(points):
            raise ValueError(f"prefill_points repeat a token count: {points}")
        self.prefill_points = points
        for name in ("decode_fixed_s", "decode_per_seq_s", "decode_per_ctx_token_s"):
            _check(name, getattr(self, name), allow_zero=True)
        _check("decode step", self.decode_fixed_s + self.decode_per_seq_s)
        _check("transfer_bytes_per_s", self.transfer_bytes_per_s)
        for name in ("transfer_latency_s", "startup_s", "request_overhead_s", "token_overhead_s"):
            _check(name, getattr(self, name), allow_zero=True)
        if self.prefill_attention_s is not None:
            _check("prefill_attention_s", self.prefill_attention_s, allow_zero=True)
        for name in (
            "kv_bytes_per_token",
            "kv_capacity_tokens",
            "max_batch_tokens",
            "max_num_seqs",
            "gpus_per_worker",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    # -- the cost model ----------------------------------------------------------------------
    def prefill_s(self, tokens: float) -> float:
        """Seconds of a step that prefills `tokens` prompt tokens (in one or many prompts):
        linear between measured points, through the origin's slope below the first and the
        last segment's slope above the last."""
        if tokens <= 0:
            return 0.0
        pts = self.prefill_points
        if len(pts) == 1:
            return pts[0][1] * tokens / pts[0][0]
        i = bisect.bisect_left([t for t, _ in pts], tokens)
        if i == 0:
            return pts[0][1] * tokens / pts[0][0]
        (t0, s0), (t1, s1) = pts[min(i, len(pts) - 1) - 1], pts[min(i, len(pts) - 1)]
        return max(s0 + (s1 - s0) * (tokens - t0) / (t1 - t0), 1e-9)

    def prefill_tokens_per_s(self, batch_tokens: float | None = None) -> float:
        """Throughput of full prefill steps (default: at the step token budget)."""
        n = self.max_batch_tokens if batch_tokens is None else batch_tokens
        return n / self.prefill_s(n)

    def decode_step_s(self, batch: float, context_tokens: float) -> float:
        """Seconds of one decode step of `batch` sequences reading `context_tokens` in all."""
        if batch <= 0:
            return 0.0
        return (
            self.decode_fixed_s
            + self.decode_per_seq_s * batch
            + self.decode_per_ctx_token_s * context_tokens
        )

    def mixed_step_s(self, prefill_tokens: float, batch: float, context_tokens: float) -> float:
        """A step that prefills and decodes together (colocated, or a short prompt prefilled
        on a decode worker): the weights are read once for both."""
        decode = self.decode_step_s(batch, context_tokens)
        if prefill_tokens <= 0:
            return decode
        if batch <= 0:
            return self.prefill_s(prefill_tokens)
        return self.prefill_s(prefill_tokens) + decode - self.decode_fixed_s

    def transfer_s(self, tokens: float) -> float:
        """Seconds to hand the KV of `tokens` prompt tokens from a prefill to a decode worker."""
        if tokens <= 0:
            return 0.0
        moved = tokens * self.kv_bytes_per_token
        return self.transfer_latency_s + moved / self.transfer_bytes_per_s

    def max_decode_batch(self, mean_context: float, tpot_s: float) -> int:
        """The largest batch whose step stays within `tpot_s` at `mean_context` tokens per
        sequence, and whose KV fits the cache (0: not even one sequence meets the target)."""
        per_seq = self.decode_per_seq_s + self.decode_per_ctx_token_s * max(mean_context, 0.0)
        room = tpot_s - self.token_overhead_s - self.decode_fixed_s
        by_time = math.floor(room / per_seq) if per_seq > 0 else self.max_num_seqs
        by_kv = math.floor(self.kv_capacity_tokens / max(mean_context, 1.0))
        return max(0, min(by_time, by_kv, self.max_num_seqs))

    # -- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefill_points"] = [list(p) for p in self.prefill_points]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CapacityProfile:
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown capacity profile field(s): {sorted(unknown)}")
        return cls(**{**d, "prefill_points": [tuple(p) for p in d["prefill_points"]]})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CapacityProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read capacity profile {path}: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a capacity profile is a JSON object")
        try:
            return cls.from_dict(data)
        except (TypeError, KeyError) as e:
            raise ValueError(f"{path}: not a capacity profile: {e}") from e


def _check(name: str, value: float, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
