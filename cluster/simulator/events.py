"""The simulator's clock: a heap of timed events, and `Flight`, one request's state in the
simulated cluster.

Events at the same instant run in a fixed order of kinds, so that a run does not depend on
the order they were pushed in: a worker that becomes ready at t serves a request arriving at
t; a request whose KV lands at t joins the step that starts at t; the planner's tick sees
everything that happened at t. A worker's step event carries the worker's step version: a
step cut short (a new sequence joins a batch mid-way) leaves a stale event in the heap, which
the loop skips.

A `Flight` goes: arrived -> routed (prefill worker + decode worker, or local: decode worker
only) -> prefilling (prompt chunks) -> first token -> [KV transfer] -> decoding -> finished.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

from cluster.simulator.traces import SimRequest

# Event kinds, in the order they run at one instant (see the module docstring).
WORKER_READY, KV_LANDED, STEP_END, TICK = 0, 1, 2, 3
# Arrivals are not in the heap (they come from the sorted trace) but rank with KV_LANDED.
ARRIVAL = KV_LANDED


class EventQueue:
    """A min-heap of (time, kind, push order, target, version)."""

    __slots__ = ("_heap", "_pushed")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any, int]] = []
        self._pushed = 0

    def push(self, time: float, kind: int, target: Any, version: int = 0) -> None:
        self._pushed += 1
        heapq.heappush(self._heap, (time, kind, self._pushed, target, version))

    def peek_key(self) -> tuple[float, int]:
        """(time, kind) of the next event; (inf, 0) when there is none."""
        if not self._heap:
            return math.inf, 0
        top = self._heap[0]
        return top[0], top[1]

    def pop(self) -> tuple[float, int, Any, int]:
        time, kind, _, target, version = heapq.heappop(self._heap)
        return time, kind, target, version

    def __len__(self) -> int:
        return len(self._heap)


@dataclass(slots=True, eq=False)
class Flight:
    """One request inside the simulation. Times are simulated seconds; NaN until reached.
    `uncached` is the prompt tokens a worker computes (the prompt minus prefix-cache hits),
    `remaining` what is left of them. `decode` is the worker that decodes it (and prefills it
    too when `local`), `prefill` its prefill worker otherwise."""

    index: int
    request: SimRequest
    local: bool = False
    uncached: int = 0
    remaining: int = 0
    decode: Any = None
    prefill: Any = None  # the prefill worker of a remote prefill
    first_token_s: float = math.nan
    finish_s: float = math.nan
    end_step: int = 0  # the decode worker's step count at which its last token is out

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def output_len(self) -> int:
        return self.request.output_len

    @property
    def kv_need(self) -> int:
        """KV tokens a decode worker reserves for it on admission: the whole sequence, so a
        simulated worker never has to preempt."""
        return self.request.prompt_len + self.request.output_len
