"""The arithmetic of `tandem bench serve`: from per-request timestamps to the reported metrics.

No I/O and no clocks here, so every number can be checked against hand-computed timestamps.

Definitions (the same as vLLM's benchmark_serving):
- TTFT: first content chunk time - send time.
- E2E: end of stream - send time.
- TPOT: (E2E - TTFT) / (output tokens - 1); undefined for a single-token output, and such a
  request counts as meeting a TPOT SLO (it has no inter-token time that could break it).
- ITL: the gaps between successive content chunks. A chunk that carries k tokens contributes k
  ITLs of gap/k (the gap is attributed evenly to its tokens); extra tokens in the first chunk
  arrived with the first token and contribute ITLs of 0. When the server only reports a total
  (the final usage chunk), the tokens beyond one per chunk are spread evenly over the chunks
  after the first (`spread_tokens`).
- Percentiles: numpy's linear interpolation. Latencies are reported in milliseconds.
- Goodput: completed requests meeting every given SLO (TTFT <= slo_ttft_ms plus
  slo_ttft_ms_per_1k per 1k prompt tokens, TPOT <= slo_tpot_ms, E2E <= slo_e2el_ms) per
  second of benchmark duration; with no SLO it is the request throughput.
  (bench/vllm_compat.py gives vLLM's result keys from the same records.)
- Failed requests are counted, never enter a latency statistic or a throughput.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.slo import SloTargets

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """One request as measured. Times are seconds; offsets are from the benchmark start."""

    index: int
    arrival_s: float  # scheduled arrival offset
    start_s: float  # offset at which it was sent (later than arrival when concurrency binds)
    prompt_len: int
    target_output_len: int
    output_len: int = 0  # tokens received
    ttft_s: float | None = None
    e2e_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        if self.arrival_s < 0 or self.start_s < 0:
            raise ValueError(f"offsets must be >= 0: {self.arrival_s}, {self.start_s}")
        if self.output_len < 0 or self.prompt_len < 0:
            raise ValueError("lengths must be >= 0")

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok:
            return None
        return request_tpot(self.ttft_s, self.e2e_s, self.output_len)

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "arrival_s": self.arrival_s,
            "start_s": self.start_s,
            "prompt_len": self.prompt_len,
            "target_output_len": self.target_output_len,
            "output_len": self.output_len,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "itls_s": list(self.itls_s),
            "error": self.error,
        }


@dataclass(frozen=True, slots=True)
class RequestTiming:
    ttft_s: float
    e2e_s: float
    itls_s: list[float]
    output_len: int


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Milliseconds; None where there were no samples."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    count: int

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "mean": self.mean,
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
            "count": self.count,
        }


@dataclass(frozen=True, slots=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    input_tok_s: float
    output_tok_s: float
    total_tok_s: float
    good_requests: int
    goodput_rps: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats

    def to_dict(self) -> dict:
        return {
            "completed": self.completed,
            "failed": self.failed,
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "input_tok_s": self.input_tok_s,
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
            "good_requests": self.good_requests,
            "goodput_rps": self.goodput_rps,
            "ttft_ms": self.ttft_ms.to_dict(),
            "tpot_ms": self.tpot_ms.to_dict(),
            "itl_ms": self.itl_ms.to_dict(),
            "e2e_ms": self.e2e_ms.to_dict(),
        }


def spread_tokens(num_chunks: int, total_tokens: int) -> list[int]:
    """Tokens per chunk when only the total is known: one per chunk, and any surplus spread
    as evenly as possible over the chunks after the first (earlier ones take the remainder).
    With fewer tokens than chunks (a server that splits a token's text), one per chunk."""
    if num_chunks < 0 or total_tokens < 0:
        raise ValueError("num_chunks and total_tokens must be >= 0")
    if num_chunks == 0:
        return []
    counts = [1] * num_chunks
    surplus = total_tokens - num_chunks
    if surplus <= 0:
        return counts
    if num_chunks == 1:
        counts[0] += surplus
        return counts
    base, rem = divmod(surplus, num_chunks - 1)
    for i in range(1, num_chunks):
        counts[i] += base + (1 if i - 1 < rem else 0)
    return counts


def itls_from_chunks(
    chunk_times_s: Sequence[float], tokens_per_chunk: Sequence[int]
) -> list[float]:
    """Inter-token latencies from chunk arrival times (see the module docstring)."""
    if len(chunk_times_s) != len(tokens_per_chunk):
        raise ValueError("one token count per chunk")
    if any(k < 1 for k in tokens_per_chunk):
        raise ValueError("every content chunk carries at least one token")
    if any(b < a for a, b in itertools.pairwise(chunk_times_s)):
        raise ValueError("chunk times must not decrease")
    if not chunk_times_s:
        return []
    itls = [0.0] * (tokens_per_chunk[0] - 1)
    for prev, cur, k in zip(chunk_times_s, chunk_times_s[1:], tokens_per_chunk[1:], strict=False):
        itls.extend([(cur - prev) / k] * k)
    return itls


def measure_request(
    start_s: float,
    chunk_times_s: Sequence[float],
    end_s: float,
    usage_output_tokens: int | None,
) -> RequestTiming:
    """Timing of one successful stream: send time, content-chunk times, end-of-stream time,
    and the output token count from the usage chunk (None: count the content chunks)."""
    if not chunk_times_s:
        raise ValueError("a stream with no content chunk has no TTFT")
    if chunk_times_s[0] < start_s or end_s < chunk_times_s[-1]:
        raise ValueError("need start <= chunk times <= end")
    n_chunks = len(chunk_times_s)
    output_len = n_chunks if usage_output_tokens is None else usage_output_tokens
    if output_len < 1:
        # Content arrived but the usage says none: believe the chunks.
        output_len = n_chunks
    itls = itls_from_chunks(chunk_times_s, spread_tokens(n_chunks, output_len))
    return RequestTiming(
        ttft_s=chunk_times_s[0] - start_s,
        e2e_s=end_s - start_s,
        itls_s=itls,
        output_len=output_len,
    )


def request_tpot(ttft_s: float, e2e_s: float, output_len: int) -> float | None:
    """(E2E - TTFT) / (tokens - 1); None for a single-token (or empty) output."""
    if output_len <= 1:
        return None
    return (e2e_s - ttft_s) / (output_len - 1)


def summarize(values_s: Sequence[float]) -> LatencyStats:
    """Mean and percentiles, seconds in, milliseconds out."""
    if len(values_s) == 0:
        return LatencyStats(None, None, None, None, 0)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = (float(np.percentile(ms, p, method="linear")) for p in PERCENTILES)
    return LatencyStats(float(ms.mean()), p50, p90, p99, int(ms.size))


def meets_slo(
    record: RequestRecord,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
    slo_e2el_ms: float | None = None,
    slo_ttft_ms_per_1k: float = 0.0,
) -> bool:
    if not record.ok:
        return False
    if slo_e2el_ms is not None and record.e2e_s * 1000.0 > slo_e2el_ms:
        return False
    # The router's SLO metrics, the planner and the simulator judge by the same rule.
    targets = SloTargets(slo_ttft_ms, slo_ttft_ms_per_1k, slo_tpot_ms)
    return targets.judge(record.prompt_len, record.ttft_s, record.tpot_s) == "met"


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    *,
    slo_e2el_ms: float | None = None,
    slo_ttft_ms_per_1k: float = 0.0,
) -> BenchMetrics:
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.ok]
    failed = len(records) - len(done)
    good = sum(
        meets_slo(r, slo_ttft_ms, slo_tpot_ms, slo_e2el_ms, slo_ttft_ms_per_1k) for r in done
    )
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    tpots = [t for t in (r.tpot_s for r in done) if t is not None]
    return BenchMetrics(
        completed=len(done),
        failed=failed,
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration_s,
        input_tok_s=total_in / duration_s,
        output_tok_s=total_out / duration_s,
        total_tok_s=(total_in + total_out) / duration_s,
        good_requests=good,
        goodput_rps=good / duration_s,
        ttft_ms=summarize([r.ttft_s for r in done]),
        tpot_ms=summarize(tpots),
        itl_ms=summarize([x for r in done for x in r.itls_s]),
        e2e_ms=summarize([r.e2e_s for r in done]),
    )
