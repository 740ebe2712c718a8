"""The math around a `CapacityProfile` that is not the profile's own cost model: the
least-squares fits that build one from measurements (`fit_decode`, `fit_line`), and what a lone
request sees on an idle worker (`idle_request`), which both `tandem profile --capacity --live`
(to isolate the overhead outside the engine) and `tandem plan` (to print TTFT/TPOT) need.

Pure Python plus numpy; no torch, no I/O. The idle-request timeline follows the simulator's
semantics (the shared design of issue 11): a prompt is prefilled in steps of at most
`max_batch_tokens` tokens, the first token appears at the end of the last prefill step and
reaches the client `request_overhead_s` later; a disaggregated request's KV then moves to a
decode worker (`transfer_s`) before its decode steps; TPOT is (last - first token) /
(output - 1) plus `token_overhead_s`.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.capacity_profile import CapacityProfile


def nnls(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Non-negative least squares, min |A x - b| with x >= 0, for a handful of unknowns: the
    unconstrained solution on every subset of the columns (the optimum's support is one of
    them), the best feasible one kept. Exact, and with 2-3 unknowns cheaper than an iterative
    solver; scipy is not a dependency."""
    a = np.asarray(rows, dtype=float)
    b = np.asarray(targets, dtype=float)
    if a.ndim != 2 or a.shape[0] != b.shape[0] or a.shape[0] == 0:
        raise ValueError(f"nnls needs a non-empty matrix and as many targets: {a.shape}, {b.shape}")
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(b * b))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x < 0):
                continue
            res = float(np.sum((sub @ x - b) ** 2))
            if res < best_res - 1e-18:
                best = np.zeros(n)
                best[list(cols)] = x
                best_res = res
    return [float(v) for v in best]


@dataclass(slots=True)
class DecodeFit:
    """decode step = fixed_s + per_seq_s * batch + per_ctx_token_s * context tokens, with the
    relative error of the fit over the points it was fitted on."""

    fixed_s: float
    per_seq_s: float
    per_ctx_token_s: float
    rel_err_mean: float
    rel_err_p90: float
    rel_err_max: float

    def predict(self, batch: float, context_tokens: float) -> float:
        return self.fixed_s + self.per_seq_s * batch + self.per_ctx_token_s * context_tokens

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def fit_decode(samples: Sequence[tuple[float, float, float]]) -> DecodeFit:
    """Fit (batch, total context tokens, step seconds) samples to the profile's decode form.

    Each row is divided by its measured time, so the fit minimises relative error: a batch-1
    step of 5 ms (what a lone request's TPOT is made of) weighs as much as a batch-64 step of
    80 ms. The coefficients are non-negative (a negative per-token cost would make a longer
    context cheaper)."""
    if len(samples) < 3:
        raise ValueError(f"a decode fit needs >= 3 samples, got {len(samples)}")
    for b, ctx, s in samples:
        if b < 1 or ctx < 0 or not (s > 0 and math.isfinite(s)):
            raise ValueError(f"bad decode sample (batch, context, seconds): {(b, ctx, s)}")
    rows = [[1.0 / s, b / s, ctx / s] for b, ctx, s in samples]
    fixed, per_seq, per_ctx = nnls(rows, [1.0] * len(samples))
    if fixed + per_seq <= 0:
        raise ValueError("the decode fit gave a step of 0 s for one sequence")
    errs = sorted(abs(fixed + per_seq * b + per_ctx * ctx - s) / s for b, ctx, s in samples)
    p90 = errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)]
    return DecodeFit(fixed, per_seq, per_ctx, statistics.fmean(errs), p90, errs[-1])


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) >= 0 of y = intercept + slope * x, by least squares."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a line fit needs >= 2 (x, y) pairs, got {len(xs)} and {len(ys)}")
    intercept, slope = nnls([[1.0, float(x)] for x in xs], list(ys))
    return intercept, slope


@dataclass(slots=True)
class IdleRequest:
    """What one request sees on idle workers (seconds): time to the first token, the mean time
    per later token, and the whole request; `engine_*` leave the overheads out."""

    prompt: int
    output: int
    disaggregated: bool
    ttft_s: float
    tpot_s: float | None  # None for a one-token answer
    total_s: float
    engine_ttft_s: float
    engine_tpot_s: float | None


def prefill_chunks_s(profile: CapacityProfile, prompt: int) -> float:
    """Seconds of the prefill steps of one `prompt`-token prompt alone on a worker (chunks of
    at most max_batch_tokens)."""
    full, rest = divmod(max(int(prompt), 0), profile.max_batch_tokens)
    return full * profile.prefill_s(profile.max_batch_tokens) + profile.prefill_s(rest)


def decode_steps_s(profile: CapacityProfile, prompt: int, output: int) -> float:
    """Seconds of the output - 1 batch-1 decode steps after the first token: the step that
    samples token i + 1 reads the KV of prompt + i tokens."""
    n = max(int(output) - 1, 0)
    if n == 0:
        return 0.0
    per_step = profile.decode_fixed_s + profile.decode_per_seq_s
    ctx_sum = n * prompt + n * (n + 1) / 2  # sum of prompt + i for i = 1..n
    return n * per_step + profile.decode_per_ctx_token_s * ctx_sum


def idle_request(
    profile: CapacityProfile, prompt: int, output: int, disaggregated: bool = True
) -> IdleRequest:
    """A lone request of `prompt` and `output` tokens on idle workers. Disaggregated: prefill
    on a prefill worker, KV hand-off, decode on a decode worker; otherwise all on one worker."""
    if prompt < 1 or output < 1:
        raise ValueError(f"prompt and output must be >= 1, got {prompt} and {output}")
    engine_ttft = prefill_chunks_s(profile, prompt)
    after_first = decode_steps_s(profile, prompt, output)
    if disaggregated and output > 1:
        after_first += profile.transfer_s(prompt)
    engine_tpot = after_first / (output - 1) if output > 1 else None
    ttft = engine_ttft + profile.request_overhead_s
    tpot = None if engine_tpot is None else engine_tpot + profile.token_overhead_s
    total = ttft + (tpot or 0.0) * (output - 1)
    return IdleRequest(prompt, output, disaggregated, ttft, tpot, total, engine_ttft, engine_tpot)
