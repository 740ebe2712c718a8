"""What the planner sees of the traffic, per window: `WindowSignals` and its `LengthHistogram`s.

A router records one `WindowSignals` per planner interval (router/signal_recorder.py); the
controller merges the windows of every router (`merge_windows`) and hands the result to the
planner (cluster/planner/). The trace-driven simulator (cluster/simulator/) builds the same
windows from simulated requests, so the live planner and the simulated one read one type.
Windows travel as plain dicts (`to_dict`/`from_dict`): Ray and msgpack carry them as is.

Lengths are kept as histograms, not means: a burst of long prompts is what breaks TTFT, and a
mean hides it. The buckets are fixed (powers of two up to 256 Ki tokens), so windows of any
router merge by adding counts; each bucket also keeps its sum, so means stay exact.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# Upper edges (inclusive) of the length buckets: 1, 2, 4, ..., 256 Ki, then anything longer.
LENGTH_EDGES: tuple[int, ...] = tuple(1 << i for i in range(19))


@dataclass(slots=True)
class LengthHistogram:
    """Counts and sums of token lengths in the fixed LENGTH_EDGES buckets (+ one overflow)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LENGTH_EDGES) + 1))
    sums: list[int] = field(default_factory=lambda: [0] * (len(LENGTH_EDGES) + 1))

    def __post_init__(self) -> None:
        n = len(LENGTH_EDGES) + 1
        if len(self.counts) != n or len(self.sums) != n:
            raise ValueError(f"a LengthHistogram has {n} buckets")

    def add(self, length: int, times: int = 1) -> None:
        i = bisect.bisect_left(LENGTH_EDGES, length)
        self.counts[i] += times
        self.sums[i] += int(length) * times

    def merge(self, other: LengthHistogram) -> None:
        for i in range(len(self.counts)):
            self.counts[i] += other.counts[i]
            self.sums[i] += other.sums[i]

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def total(self) -> int:
        return sum(self.sums)

    def mean(self) -> float:
        n = self.count
        return self.total / n if n else 0.0

    def buckets(self) -> list[tuple[float, float]]:
        """(share of the requests, mean length) of every non-empty bucket: the distribution
        the planner sizes against."""
        n = self.count
        if not n:
            return []
        return [(c / n, s / c) for c, s in zip(self.counts, self.sums, strict=True) if c]

    def quantile(self, q: float) -> float:
        """The q-quantile (0..1), interpolated linearly inside its bucket."""
        n = self.count
        if not n:
            return 0.0
        rank, seen = q * n, 0
        for i, c in enumerate(self.counts):
            if c and seen + c >= rank:
                lo = LENGTH_EDGES[i - 1] if i else 0
                hi = LENGTH_EDGES[i] if i < len(LENGTH_EDGES) else max(lo, self.sums[i] / c) * 2
                return lo + (hi - lo) * (rank - seen) / c
            seen += c
        return float(LENGTH_EDGES[-1])

    def share_above(self, threshold: int) -> tuple[float, float]:
        """(share of requests, share of tokens) with length >= threshold, by bucket means: the
        part of the prompts the prefill pool gets when shorter ones are prefilled locally."""
        n, total = self.count, self.total
        if not n:
            return 0.0, 0.0
        req = tok = 0
        for c, s in zip(self.counts, self.sums, strict=True):
            if c and s / c >= threshold:
                req, tok = req + c, tok + s
        return req / n, (tok / total if total else 0.0)

    def to_dict(self) -> dict:
        return {"counts": list(self.counts), "sums": list(self.sums)}

    @classmethod
    def from_dict(cls, d: dict) -> LengthHistogram:
        return cls(counts=[int(c) for c in d["counts"]], sums=[int(s) for s in d["sums"]])


@dataclass(slots=True)
class LatencySummary:
    """Observed latencies of a window (seconds): percentiles and how many samples."""

    count: int = 0
    p50: float = math.nan
    p90: float = math.nan
    p99: float = math.nan

    @classmethod
    def of(cls, samples: list[float]) -> LatencySummary:
        if not samples:
            return cls()
        s = sorted(samples)

        def pick(q: float) -> float:
            return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

        return cls(len(s), pick(0.5), pick(0.9), pick(0.99))

    def to_dict(self) -> dict:
        return {"count": self.count, "p50": self.p50, "p90": self.p90, "p99": self.p99}

    @classmethod
    def from_dict(cls, d: dict) -> LatencySummary:
        return cls(int(d["count"]), float(d["p50"]), float(d["p90"]), float(d["p99"]))


@dataclass(slots=True)
class WindowSignals:
    """One planner window of traffic, as a router (or the simulator) saw it.

    Rates are per window (divide by `duration_s`); queue and KV numbers are the state at the
    window's end. `uncached_prompt_tokens` is the prompt tokens arriving minus prefix-cache
    hits (for prompts routed by the KV index: what the chosen worker lacks; otherwise the
    workers' hit share; router/signal_recorder.py), `local_prefills` the arrivals prefilled
    on a decode worker (shorter than the disaggregation threshold). Latencies are of the
    requests that got their first token (TTFT) or finished (TPOT) in the window."""

    start_s: float
    duration_s: float
    arrivals: int = 0
    prompt_lengths: LengthHistogram = field(default_factory=LengthHistogram)
    output_lengths: LengthHistogram = field(default_factory=LengthHistogram)
    uncached_prompt_tokens: int = 0
    local_prefills: int = 0
    finished: int = 0
    queued_requests: int = 0  # admitted by a router, waiting for their first token
    queued_prompt_tokens: int = 0
    prefill_waiting: int = 0  # requests queued inside prefill workers
    decode_running: int = 0
    decode_waiting: int = 0
    kv_usage: float = 0.0  # the fullest decode worker's KV cache, 0..1
    # The most prompt tokens that arrived within one second (slots of 1 s from start_s): a
    # burst inside the window, which its mean rate hides (0: not measured).
    peak_prompt_tokens_1s: int = 0
    ttft: LatencySummary = field(default_factory=LatencySummary)
    tpot: LatencySummary = field(default_factory=LatencySummary)

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")

    @property
    def arrival_rate(self) -> float:
        return self.arrivals / self.duration_s

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        for name in ("prompt_lengths", "output_lengths", "ttft", "tpot"):
            d[name] = d[name].to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> WindowSignals:
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown window signal field(s): {sorted(unknown)}")
        d = dict(d)
        for name in ("prompt_lengths", "output_lengths"):
            if name in d:
                d[name] = LengthHistogram.from_dict(d[name])
        for name in ("ttft", "tpot"):
            if name in d:
                d[name] = LatencySummary.from_dict(d[name])
        return cls(**d)


def merge_windows(windows: list[WindowSignals]) -> WindowSignals:
    """Several routers' windows of the same interval as one: counts add, queues add, KV usage
    is the worst, latency percentiles are the sample-weighted mean of each router's (exact
    with one router, an approximation with several)."""
    if not windows:
        raise ValueError("no windows to merge")
    out = WindowSignals(
        start_s=min(w.start_s for w in windows), duration_s=max(w.duration_s for w in windows)
    )
    for w in windows:
        out.prompt_lengths.merge(w.prompt_lengths)
        out.output_lengths.merge(w.output_lengths)
        for name in (
            "arrivals",
            "uncached_prompt_tokens",
            "local_prefills",
            "finished",
            "queued_requests",
            "queued_prompt_tokens",
        ):
            setattr(out, name, getattr(out, name) + getattr(w, name))
    # Worker-side numbers are the same pools seen by every router: take the latest view.
    last = max(windows, key=lambda w: w.start_s + w.duration_s)
    out.prefill_waiting, out.decode_running = last.prefill_waiting, last.decode_running
    out.decode_waiting = last.decode_waiting
    out.kv_usage = max(w.kv_usage for w in windows)
    # Routers' peaks need not fall in the same second: their sum is an upper bound.
    out.peak_prompt_tokens_1s = sum(w.peak_prompt_tokens_1s for w in windows)
    out.ttft = _merge_latency([w.ttft for w in windows])
    out.tpot = _merge_latency([w.tpot for w in windows])
    return out


def _merge_latency(parts: list[LatencySummary]) -> LatencySummary:
    parts = [p for p in parts if p.count]
    if not parts:
        return LatencySummary()
    n = sum(p.count for p in parts)

    def avg(name: str) -> float:
        return sum(getattr(p, name) * p.count for p in parts) / n

    return LatencySummary(n, avg("p50"), avg("p90"), avg("p99"))


def concat_windows(windows: list[WindowSignals]) -> WindowSignals:
    """Consecutive windows of one router as one window spanning them all: counts add, the
    queue and KV state is the last window's, latency percentiles are sample-weighted."""
    if not windows:
        raise ValueError("no windows to concatenate")
    ordered = sorted(windows, key=lambda w: w.start_s)
    first, last = ordered[0], ordered[-1]
    out = merge_windows(ordered)
    out.start_s = first.start_s
    out.duration_s = max(last.start_s + last.duration_s - first.start_s, last.duration_s)
    out.queued_requests, out.queued_prompt_tokens = last.queued_requests, last.queued_prompt_tokens
    out.kv_usage = last.kv_usage
    out.peak_prompt_tokens_1s = max(w.peak_prompt_tokens_1s for w in ordered)
    return out
