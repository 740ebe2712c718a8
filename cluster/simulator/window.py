"""The simulator's side of router/signals.py: it records one planner window of simulated
traffic and closes it into the same `WindowSignals` a live router reports.

Lifecycle per window: `arrival` (at arrival: count, prompt length), `routed` (uncached
prompt tokens after prefix hits, local prefills), `first_token` (TTFT sample), `finished`
(output length, TPOT sample) -> `close(now, state)` returns the window (with the queue and KV
state at its end, from the cluster) and starts the next one. `close` also returns the
window's demand in tokens per second of arrivals (the trace's output lengths included), for
the replica-timeline plot: the planner itself never sees an output length before the request
finishes.
"""

from __future__ import annotations

from cluster.simulator.events import Flight
from router.signals import LatencySummary, LengthHistogram, WindowSignals


class WindowRecorder:
    __slots__ = (
        "start_s", "arrivals", "prompt_lengths", "output_lengths", "uncached", "local",
        "finished_count", "ttft", "tpot", "demand_prompt", "demand_output", "slot", "slot_tokens",
        "peak_1s",
    )  # fmt: skip

    def __init__(self, start_s: float = 0.0) -> None:
        self.start_s = start_s
        self._reset()

    def _reset(self) -> None:
        self.arrivals = self.uncached = self.local = self.finished_count = 0
        self.demand_prompt = self.demand_output = 0
        self.slot = self.slot_tokens = self.peak_1s = 0
        self.prompt_lengths, self.output_lengths = LengthHistogram(), LengthHistogram()
        self.ttft: list[float] = []
        self.tpot: list[float] = []

    def arrival(self, flight: Flight) -> None:
        self.arrivals += 1
        self.prompt_lengths.add(flight.prompt_len)
        self.demand_prompt += flight.prompt_len
        self.demand_output += flight.output_len
        # Prompt tokens per 1-s slot from the window's start: the burst signal.
        slot = int(flight.request.arrival_s - self.start_s)
        if slot != self.slot:
            self.slot, self.slot_tokens = slot, 0
        self.slot_tokens += flight.prompt_len
        self.peak_1s = max(self.peak_1s, self.slot_tokens)

    def routed(self, flight: Flight) -> None:
        self.uncached += flight.uncached
        self.local += flight.local

    def first_token(self, ttft_s: float) -> None:
        self.ttft.append(ttft_s)

    def finished(self, flight: Flight, tpot_s: float | None) -> None:
        self.finished_count += 1
        self.output_lengths.add(flight.output_len)
        if tpot_s is not None:
            self.tpot.append(tpot_s)

    def close(self, now: float, state: dict[str, float]) -> tuple[WindowSignals, dict]:
        """The window [start_s, now) as WindowSignals, and its demand; the next one starts."""
        duration = now - self.start_s
        window = WindowSignals(
            start_s=self.start_s,
            duration_s=duration,
            arrivals=self.arrivals,
            prompt_lengths=self.prompt_lengths,
            output_lengths=self.output_lengths,
            uncached_prompt_tokens=self.uncached,
            local_prefills=self.local,
            finished=self.finished_count,
            queued_requests=int(state["queued_requests"]),
            queued_prompt_tokens=int(state["queued_prompt_tokens"]),
            prefill_waiting=int(state["prefill_waiting"]),
            decode_running=int(state["decode_running"]),
            decode_waiting=int(state["decode_waiting"]),
            kv_usage=float(state["kv_usage"]),
            peak_prompt_tokens_1s=self.peak_1s,
            ttft=LatencySummary.of(self.ttft),
            tpot=LatencySummary.of(self.tpot),
        )
        demand = {
            "start_s": self.start_s,
            "duration_s": duration,
            "arrivals": self.arrivals,
            "prompt_tokens_per_s": self.demand_prompt / duration,
            "output_tokens_per_s": self.demand_output / duration,
        }
        self.start_s = now
        self._reset()
        return window, demand
