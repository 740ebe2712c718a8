"""What a `tandem bench serve` run hands back and writes: `BenchResult` (its JSON document),
the printed table (`format_report`) and `finish`, which prints it and writes the JSON and the
plots the config names.

The JSON puts the headline metrics at the top level, then vLLM's `vllm bench serve` keys
(bench/vllm_compat.py: duration, request_goodput, output_throughput, mean_ttft_ms,
p99_ttft_ms, ...), then the arrival process, the config (API key redacted) and every request's
record. JSON floats that are infinite (an all-at-once request rate) are written as the string
"inf".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from bench.config import BenchConfig, json_float
from bench.metrics import BenchMetrics, RequestRecord
from bench.traces import TraceSummary
from bench.vllm_compat import vllm_keys


@dataclass(slots=True)
class BenchResult:
    config: BenchConfig
    metrics: BenchMetrics
    records: list[RequestRecord]
    model: str | None
    started_at: str
    trace: TraceSummary | None = None
    errors: dict[str, int] = field(default_factory=dict)

    def arrivals(self) -> str:
        """The arrival process, by name, as the JSON reports it."""
        if self.trace:
            return "trace"
        if math.isinf(self.config.request_rate):
            return "all-at-once"
        return "poisson" if self.config.burstiness == 1.0 else "gamma"

    def to_dict(self) -> dict:
        """The JSON document: headline metrics at the top level, then config and requests."""
        out: dict = self.metrics.to_dict()
        cfg = self.config
        # Where both name a number (completed, total_*_tokens, request_throughput) they agree.
        out.update(
            vllm_keys(
                self.records,
                self.metrics.duration_s,
                metrics=cfg.percentile_metric_names,
                percentiles=cfg.metric_percentile_values,
                goodput=cfg.slos or None,
            )
        )
        slo = {f"{k}_ms": v for k, v in cfg.slos.items()}
        out.update(
            {
                "request_rate": json_float(self.trace.rate_rps if self.trace else cfg.request_rate),
                "arrivals": self.arrivals(),
                "burstiness": None if self.trace else cfg.burstiness,
                "max_concurrency": cfg.max_concurrency,
                "slo": {"ttft_ms": None, "tpot_ms": None} | slo,
                "model": self.model,
                "endpoint": cfg.endpoint,
                "dataset": cfg.dataset,
                "started_at": self.started_at,
                "errors": dict(self.errors),
                "config": cfg.to_dict(),
                "requests": [r.to_dict() for r in self.records],
            }
        )
        if self.trace:
            out["trace"] = {
                "path": cfg.trace_path,
                "length_scale": cfg.trace_length_scale,
                "time_scale": cfg.trace_time_scale,
                "max_input": cfg.trace_max_input,
                "max_output": cfg.trace_max_output,
                **self.trace.to_dict(),
            }
        if cfg.sharegpt_path:
            out["sharegpt"] = {
                "path": cfg.sharegpt_path,
                "tokenizer": cfg.tokenizer or cfg.model or self.model,
                "output_len": cfg.sharegpt_output_len,
                "num_requests": len(self.records),
            }
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path


WIDTH = 60


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _row(name: str, value: object) -> str:
    return f"{name:<40}{value!s:>20}"


def _workload_rows(result: BenchResult) -> list[str]:
    cfg, trace = result.config, result.trace
    if cfg.sharegpt_path:
        n = max(1, len(result.records))
        return [
            f"  sharegpt file: {cfg.sharegpt_path}",
            _row("Request rate (req/s):", f"{cfg.request_rate:g}"),
            _row("Burstiness:", f"{cfg.burstiness:g}"),
            _row(
                "  mean prompt / output len:",
                f"{sum(r.prompt_len for r in result.records) / n:.1f} / "
                f"{sum(r.target_output_len for r in result.records) / n:.1f}",
            ),
        ]
    if trace is None:
        return [
            _row("Request rate (req/s):", f"{cfg.request_rate:g}"),
            _row("Burstiness:", f"{cfg.burstiness:g}"),
            _row("Input len / range:", f"{cfg.input_len} / {cfg.input_range:g}"),
            _row("Output len / range:", f"{cfg.output_len} / {cfg.output_range:g}"),
        ]
    rate = _fmt(trace.rate_rps) if math.isfinite(trace.rate_rps) else "inf"
    return [
        f"  trace file: {cfg.trace_path}",
        _row(
            "  length scale / time scale:", f"{cfg.trace_length_scale:g} / {cfg.trace_time_scale:g}"
        ),
        _row("  max input / max output:", f"{cfg.trace_max_input} / {cfg.trace_max_output}"),
        _row("  offered rate (req/s):", rate),
        _row(
            "  mean prompt / output len:",
            f"{trace.mean_prompt_len:.1f} / {trace.mean_output_len:.1f}",
        ),
    ]


def _throughput_rows(result: BenchResult) -> list[str]:
    m, cfg = result.metrics, result.config
    lines = [_row("Successful requests:", m.completed), _row("Failed requests:", m.failed)]
    for error, count in list(result.errors.items())[:5]:
        lines.append(f"  {count} x {error[: WIDTH - 8]}")
    slo_text = " ".join(f"{k.upper()}<={v:g}ms" for k, v in cfg.slos.items()) or "(no SLO)"
    return lines + [
        _row("Benchmark duration (s):", _fmt(m.duration_s)),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", _fmt(m.request_throughput)),
        _row(f"Goodput (req/s) {slo_text}:", _fmt(m.goodput_rps)),
        _row("Output token throughput (tok/s):", _fmt(m.output_tok_s)),
        _row("Total token throughput (tok/s):", _fmt(m.total_tok_s)),
    ]


def _latency_rows(metrics: BenchMetrics) -> list[str]:
    sections = (
        ("Time to First Token", "TTFT", metrics.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", metrics.tpot_ms),
        ("Inter-token Latency", "ITL", metrics.itl_ms),
        ("End-to-end Latency", "E2E", metrics.e2e_ms),
    )
    lines = []
    for title, short, stats in sections:
        lines.append(f" {title} ".center(WIDTH, "-"))
        for key in ("mean", "p50", "p90", "p99"):
            lines.append(_row(f"{key.capitalize()} {short} (ms):", _fmt(getattr(stats, key))))
    return lines


def format_report(result: BenchResult) -> str:
    cfg = result.config
    lines = ["=" * WIDTH, " tandem bench serve ".center(WIDTH, "="), "=" * WIDTH]
    lines.append(_row("Endpoint:", cfg.endpoint))
    lines.append(_row("Model:", result.model or "(none sent)"))
    lines.append(_row("Dataset:", cfg.dataset_kind))
    lines += _workload_rows(result)
    lines.append(_row("Max concurrency:", cfg.max_concurrency or "unbounded"))
    lines += _throughput_rows(result)
    lines += _latency_rows(result.metrics)
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def finish(result: BenchResult) -> list[Path]:
    """Print the report and write the JSON and plots the config asks for."""
    cfg = result.config
    print(format_report(result))
    written: list[Path] = []
    if cfg.result_json:
        written.append(result.write_json(cfg.result_json))
    if cfg.plot_dir:
        from bench.plots import plot_results  # matplotlib only when plots are asked

        written += plot_results(
            result.records,
            cfg.plot_dir,
            slo_ttft_ms=cfg.slos.get("ttft"),
            slo_tpot_ms=cfg.slos.get("tpot"),
            label=cfg.dataset,
        )
    for path in written:
        print(f"wrote {path}")
    return written
