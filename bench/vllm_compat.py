"""The keys of vLLM's `vllm bench serve` result JSON, computed from tandem's request records, so
scripts and dashboards written for vLLM's results read tandem's unchanged.

`vllm_keys` gives: duration, completed, total_input_tokens, total_output_tokens,
request_throughput, request_goodput, output_throughput, total_token_throughput, and for each
metric of `--percentile-metrics` (ttft, tpot, itl, e2el) mean_X_ms, median_X_ms, std_X_ms and
pP_X_ms for each P of `--metric-percentiles` (99.9 gives p99.9_X_ms, 99 gives p99_X_ms).

vLLM's arithmetic, kept where it differs from tandem's own report:
- an empty sample set gives 0.0 (vLLM takes statistics of `values or 0`), not None;
- std is the population standard deviation (numpy's default, ddof=0);
- request_goodput is None unless an SLO was given; a request is good when it meets every
  given SLO (`<=`, in ms); a single-token output has no TPOT and counts as meeting a TPOT SLO
  (vLLM scores its TPOT as 0).
The samples are tandem's (bench/metrics.py): ITLs of a multi-token chunk are its gap spread
over its tokens, where vLLM records one gap per chunk; with one token per chunk they agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from bench.metrics import RequestRecord

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """`"ttft,tpot,itl"` -> ("ttft", "tpot", "itl"); unknown or repeated names are an error."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError("percentile_metrics names no metric")
    unknown = [n for n in names if n not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(
            f"percentile_metrics: unknown {unknown}; choose from {', '.join(PERCENTILE_METRICS)}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"percentile_metrics repeats a name: {text!r}")
    return names


def parse_metric_percentiles(text: str) -> tuple[float, ...]:
    """`"50,99.9"` -> (50.0, 99.9); each must lie in [0, 100]."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise ValueError(f"metric_percentiles must be numbers, got {text!r}") from exc
    if not values:
        raise ValueError("metric_percentiles names no percentile")
    if any(not 0.0 <= p <= 100.0 for p in values):
        raise ValueError(f"metric_percentiles must lie in [0, 100], got {text!r}")
    return values


def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0}: SLOs in milliseconds."""
    out: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            if not sep:
                raise ValueError(pair)
            out[name.strip()] = float(value)
        except ValueError as exc:
            raise ValueError(
                f"goodput: {pair!r} is not KEY:VALUE (a metric name and milliseconds, "
                "e.g. ttft:500)"
            ) from exc
    check_goodput(out)
    return out


def check_goodput(slos: Mapping[str, float]) -> None:
    unknown = [k for k in slos if k not in GOODPUT_METRICS]
    if unknown:
        raise ValueError(f"goodput: unknown {unknown}; choose from {', '.join(GOODPUT_METRICS)}")
    negative = {k: v for k, v in slos.items() if not v >= 0}
    if negative:
        raise ValueError(f"goodput SLOs must be >= 0 ms, got {negative}")


def percentile_key(p: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def is_good(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """A completed request within every given SLO (ms, inclusive)."""
    if not record.ok:
        return False
    tpot = record.tpot_s or 0.0  # vLLM: a single-token output's TPOT is 0
    values_s = {"ttft": record.ttft_s, "tpot": tpot, "e2el": record.e2e_s}
    return all(values_s[name] * 1000.0 <= slo for name, slo in slos.items())


def _samples_s(done: Sequence[RequestRecord]) -> dict[str, list[float]]:
    return {
        "ttft": [r.ttft_s for r in done],
        # Statistics over multi-token outputs only, as vLLM's `tpots`.
        "tpot": [t for t in (r.tpot_s for r in done) if t is not None],
        "itl": [x for r in done for x in r.itls_s],
        "e2el": [r.e2e_s for r in done],
    }


def vllm_keys(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    percentiles: Sequence[float] = (99.0,),
    goodput: Mapping[str, float] | None = None,
) -> dict[str, float | int | None]:
    """vLLM's result keys for one run (see the module docstring)."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    check_goodput(goodput or {})
    done = [r for r in records if r.ok]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    out: dict[str, float | int | None] = {
        "duration": duration_s,
        "completed": len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "request_goodput": (
            sum(is_good(r, goodput) for r in done) / duration_s if goodput else None
        ),
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    samples = _samples_s(done)
    for name in metrics:
        if name not in PERCENTILE_METRICS:
            raise ValueError(f"unknown percentile metric {name!r}")
        ms = np.asarray(samples[name] or [0.0], dtype=np.float64) * 1000.0
        out[f"mean_{name}_ms"] = float(np.mean(ms))
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"std_{name}_ms"] = float(np.std(ms))
        for p in percentiles:
            out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out
