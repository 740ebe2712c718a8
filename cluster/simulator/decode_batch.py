"""A decode worker's running batch, advanced many steps at a time.

Between two events that change it (a sequence finishes, one joins, a local prefill starts),
a batch of `b` sequences whose contexts sum to `C` runs identical steps except that each
step reads `b` more tokens of context than the one before. Step j (0-based) of such a run
takes `decode_step_s(b, C + j*b)`, so k steps take an arithmetic series summed exactly by
`decode_span_s`; `step_in_progress` inverts it (which step is running `elapsed` seconds in).
The simulator therefore spends one event per batch change, not one per token.

Lifecycle of a sequence in the batch: `add` (after its first token, on admission or at the
end of its local prefill) -> `advance(k)` moves every sequence k tokens on -> `pop_finished`
returns those whose last token came out. `end_step` is counted on the worker's step counter,
so a sequence's finish is known on admission and kept in a heap.
"""

from __future__ import annotations

import heapq
import math

from bench.capacity_profile import CapacityProfile
from cluster.simulator.events import Flight


class DecodeBatch:
    """The decoding sequences of one worker: their count, the sum of their contexts (the KV
    one step reads: prompt plus tokens so far, per sequence) and their finish steps."""

    __slots__ = ("steps", "size", "context", "_ends", "_pushed")

    def __init__(self) -> None:
        self.steps = 0  # decode steps this worker has run (mixed steps included)
        self.size = 0
        self.context = 0
        self._ends: list[tuple[int, int, Flight]] = []
        self._pushed = 0

    def add(self, flight: Flight, emitted: int = 1) -> None:
        """Join a sequence that has `emitted` tokens out already (its first, from prefill)."""
        flight.end_step = self.steps + flight.output_len - emitted
        self.context += flight.prompt_len + emitted
        self.size += 1
        self._pushed += 1
        heapq.heappush(self._ends, (flight.end_step, self._pushed, flight))

    def advance(self, k: int) -> None:
        """k steps ran: every sequence emitted k tokens."""
        self.steps += k
        self.context += self.size * k

    def pop_finished(self) -> list[Flight]:
        done = []
        ends = self._ends
        while ends and ends[0][0] <= self.steps:
            flight = heapq.heappop(ends)[2]
            self.context -= flight.prompt_len + flight.output_len
            self.size -= 1
            done.append(flight)
        return done

    def steps_to_next_finish(self) -> int:
        return self._ends[0][0] - self.steps if self._ends else 0


def decode_span_s(profile: CapacityProfile, batch: int, context: int, k: int) -> float:
    """Seconds of k decode steps of `batch` sequences whose contexts sum to `context` at the
    first step; each step adds `batch` tokens of context (the arithmetic series, exactly)."""
    per_step = profile.decode_fixed_s + profile.decode_per_seq_s * batch
    return k * per_step + profile.decode_per_ctx_token_s * (k * context + batch * k * (k - 1) / 2)


def step_in_progress(
    profile: CapacityProfile, batch: int, context: int, elapsed: float, k_max: int
) -> int:
    """The step running `elapsed` seconds into a run started with (batch, context): the
    smallest k in [1, k_max] with decode_span_s(k) >= elapsed (a step ending exactly then
    counts as the one in progress)."""
    if elapsed <= 0:
        return 1
    a = profile.decode_per_ctx_token_s * batch / 2  # span = a k^2 + b k
    b = (
        profile.decode_fixed_s
        + profile.decode_per_seq_s * batch
        + profile.decode_per_ctx_token_s * (context - batch / 2)
    )
    # The positive root of a k^2 + b k = elapsed, in the form that stays exact as a -> 0.
    root = 2 * elapsed / (b + math.sqrt(b * b + 4 * a * elapsed))
    k = max(1, min(k_max, math.ceil(root)))
    # Rounding can put the ceiling one off; settle it on the series itself.
    while k > 1 and decode_span_s(profile, batch, context, k - 1) >= elapsed:
        k -= 1
    while k < k_max and decode_span_s(profile, batch, context, k) < elapsed:
        k += 1
    return k
