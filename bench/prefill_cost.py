"""`PrefillCost`: what a step that computes prompt chunks costs, from the profile's
single-prompt curve.

The profile measures `prefill_s(n)` for one fresh prompt of n tokens alone in a step. A step
of several chunks is not one prompt of as many tokens: the projections and MLP cost grow with
the step's tokens, but attention is per sequence, each chunk's queries reading its own
sequence (its earlier chunks and itself), not the other prompts. Charging a batch of k
prompts of n tokens as one prompt of k*n tokens counts attention k times over (on the CPU
profile of the `small` llama, a step of 128 prompts of 16 tokens measured 0.31 s; the curve at
2048 tokens says 0.89 s).

So the curve is split into a part that grows with the step's tokens and one that grows with
the square of a prompt's length (causal attention), by a non-negative least-squares fit of
prefill_s(n) ~ a + b*n + q*n^2 over the profile's points (relative error). Points on a flat
start are left out of the fit: a GPU step of a few tokens takes the time of reading the
weights whatever the tokens (the roofline's max(memory, compute), not a sum), and a quadratic
bent through that floor and the compute-bound points puts half of a long step in "attention"
(on the H100 roofline it priced a step of eight 1024-token prompts at 0.14 s, under the
0.24 s its GEMMs alone take at that profile's FLOP/s). A step of chunks
(n_i new tokens after c_i tokens of the same prompt already in the cache) then costs

    prefill_s(N) - q*N^2 + q * sum(n_i^2 + 2*n_i*c_i),    N = sum(n_i)

the curve at the step's tokens, with one N-token prompt's attention swapped for the chunks'
own. A single fresh prompt costs exactly prefill_s(n), and a profile whose curve is linear
(q = 0) is charged exactly as before. A mixed step (decodes beside the chunks) adds the decode
step without its fixed part (the weights are read once), as `CapacityProfile.mixed_step_s`.
`attention_s` is the step's attention part alone: a worker that shares its machine slows down
in the other part (workers.py).

Lifecycle: built once per simulated cluster from its profile; then only read.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.capacity_model import nnls
from bench.capacity_profile import CapacityProfile

FLAT = 1.05  # a point within 5% of the first point's time is on the curve's flat start


def attention_coefficient(profile: CapacityProfile) -> float:
    """q of prefill_s(n) ~ a + b*n + q*n^2 (all >= 0), fitted by relative error to the
    profile's points past its flat start (the points within `FLAT` of the first point's time,
    when there are several: on the H100 roofline this recovers its attention term exactly);
    0 with fewer than three such points (no curvature to see)."""
    points = sorted(profile.prefill_points)
    flat = [i for i, (_, s) in enumerate(points) if s <= FLAT * points[0][1]]
    points = points[flat[-1] + 1 :] if len(flat) > 1 else points
    if len(points) < 3:
        return 0.0
    rows = [[1.0 / s, n / s, n * n / s] for n, s in points]
    _, _, q = nnls(rows, [1.0] * len(points))
    return q


class PrefillCost:
    __slots__ = ("profile", "q")

    def __init__(self, profile: CapacityProfile) -> None:
        self.profile = profile
        known = profile.prefill_attention_s
        self.q = attention_coefficient(profile) if known is None else known

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds of a prefill step computing `chunks`: (new tokens, tokens of the same
        prompt already computed or cached) each."""
        total = sum(n for n, _ in chunks)
        if total <= 0:
            return 0.0
        base = self.profile.prefill_s(total)
        if self.q == 0.0:
            return base
        own = sum(n * n + 2 * n * c for n, c in chunks)
        return max(base + self.q * (own - total * total), 1e-9)

    def prompt_work_s(self, tokens: float, cached: float = 0.0) -> float:
        """The seconds one prompt adds to full steps: `tokens` new tokens at the per-token
        cost of a full step (`max_batch_tokens`) without its attention, plus their own
        attention (after `cached` tokens of the same prompt). A prefill worker kept busy
        serves a mix of prompts at sum(tokens) / sum(prompt_work_s): its throughput depends
        on the prompt lengths, as the simulated steps do (the planner sizes with it)."""
        if tokens <= 0:
            return 0.0
        full = float(self.profile.max_batch_tokens)
        linear = max(self.profile.prefill_s(full) - self.q * full * full, 1e-12) / full
        return tokens * linear + self.q * (tokens * tokens + 2 * tokens * cached)

    def attention_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """The part of `step_s(chunks)` the fit puts in attention (each chunk's queries against
        its own prompt); the rest grows with the step's tokens (projections, MLP, weights)."""
        return min(self.q * sum(n * n + 2 * n * c for n, c in chunks), self.step_s(chunks))

    def mixed_step_s(self, chunks: Sequence[tuple[int, int]], batch: int, context: int) -> float:
        """A step that computes `chunks` and decodes `batch` sequences reading `context`."""
        decode = self.profile.decode_step_s(batch, context)
        if not chunks:
            return decode
        prefill = self.step_s(chunks)
        if batch <= 0:
            return prefill
        return prefill + decode - self.profile.decode_fixed_s
