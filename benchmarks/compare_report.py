"""The report side of `benchmarks/compare_disagg.py`: one measured point per (scenario, mode,
rate), the TPOT p99 ratios disagg/colocated, compare.json, compare.md and the plots."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# disagg-quantized: the same 1P1D with `tandem serve --quantized` (FP8 W8A8 prefill, int8
# weight-only decode on CPU, FP8 KV), against the same unquantized colocated baselines.
MODES = ("disagg", "disagg-quantized", "colocated-chunked", "colocated-nochunk")
DISAGG_MODES = ("disagg", "disagg-quantized")


@dataclass(slots=True)
class Point:
    scenario: str
    mode: str
    rate: float
    completed: int
    failed: int
    duration_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    itl_p99_ms: float | None
    output_tok_s: float
    goodput_rps: float
    request_throughput: float
    load_avg_1m: float
    raw_json: str = ""
    worker_stats: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, float]:
        return (self.scenario, self.mode, self.rate)


# --------------------------------------------------------------------------- reporting


def _cell(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def ratios(points: list[Point]) -> list[dict]:
    by = {p.key: p for p in points}
    rows = []
    for p in points:
        if p.mode not in DISAGG_MODES:
            continue
        row = {"scenario": p.scenario, "rate": p.rate, "mode": p.mode}
        for other in ("colocated-chunked", "colocated-nochunk"):
            q = by.get((p.scenario, other, p.rate))
            ok = q and q.tpot_p99_ms and p.tpot_p99_ms is not None
            row[other] = p.tpot_p99_ms / q.tpot_p99_ms if ok else None
        rows.append(row)
    return rows


def markdown(points: list[Point], meta: dict, scenarios: dict) -> str:
    """`scenarios`: name -> compare_disagg.Scenario, for the row order."""
    lines = [
        "| scenario | rate (req/s) | mode | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) "
        "| TPOT p99 (ms) | output tok/s | goodput (req/s) | ok/sent |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {m: i for i, m in enumerate(MODES)}
    scen_order = {s: i for i, s in enumerate(scenarios)}
    for p in sorted(
        points, key=lambda p: (scen_order.get(p.scenario, 9), p.rate, order.get(p.mode, 9))
    ):
        lines.append(
            f"| {p.scenario} | {p.rate:g} | {p.mode} | {_cell(p.ttft_p50_ms)} | "
            f"{_cell(p.ttft_p99_ms)} | {_cell(p.tpot_p50_ms, 1)} | {_cell(p.tpot_p99_ms, 1)} | "
            f"{p.output_tok_s:.1f} | {p.goodput_rps:.3f} | {p.completed}/"
            f"{p.completed + p.failed} |"
        )
    lines += [
        "",
        "TPOT p99 ratio, disagg (bf16 or quantized) / colocated (below 1: disaggregation has the "
        "lower tail):",
        "",
        "| scenario | rate (req/s) | mode | vs colocated-chunked | vs colocated-nochunk |",
        "|---|---|---|---|---|",
    ]
    rows = ratios(points)
    for r in sorted(rows, key=lambda r: (scen_order.get(r["scenario"], 9), r["rate"], r["mode"])):
        lines.append(
            f"| {r['scenario']} | {r['rate']:g} | {r['mode']} | "
            f"{_cell(r['colocated-chunked'], 2)} | {_cell(r['colocated-nochunk'], 2)} |"
        )
    lines += ["", "Scenarios and goodput SLOs:", ""]
    for s in meta["scenarios"]:
        lines.append(
            f"- {s['name']}: {s['lengths']}, {s['num_prompts']} requests per point, "
            f"Poisson arrivals; goodput SLO TTFT <= {s['slo_ttft_ms']:g} ms and "
            f"TPOT <= {s['slo_tpot_ms']:g} ms"
        )
    lines += [
        "",
        f"Machine: {meta['cpu']} ({meta['logical_cpus']} logical CPUs), model "
        f"`{meta['model_name']}` {meta['dtype']}, one core per worker; 1-min load average "
        f"during the points {meta['load_min']:.1f}-{meta['load_max']:.1f}.",
        f"Command: `{meta['command']}`",
    ]
    return "\n".join(lines) + "\n"


def plot(points: list[Point], out: Path, scenarios: dict) -> list[Path]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths = []
    styles = {
        "disagg": ("o-", "tab:blue"),
        "disagg-quantized": ("D-", "tab:green"),
        "colocated-chunked": ("s--", "tab:orange"),
        "colocated-nochunk": ("^:", "tab:red"),
    }
    for scen in dict.fromkeys(p.scenario for p in points):
        fig = Figure(figsize=(13.5, 4.0))
        FigureCanvasAgg(fig)
        panels = (
            ("tpot_p99_ms", "TPOT p99 (ms)"),
            ("ttft_p50_ms", "TTFT p50 (ms)"),
            ("goodput_rps", "goodput (req/s)"),
        )
        for i, (attr, label) in enumerate(panels):
            ax = fig.add_subplot(1, 3, i + 1)
            for mode in MODES:
                pts = sorted(
                    (p for p in points if p.scenario == scen and p.mode == mode),
                    key=lambda p: p.rate,
                )
                xy = [(p.rate, getattr(p, attr)) for p in pts if getattr(p, attr) is not None]
                if xy:
                    style, color = styles[mode]
                    ax.plot(*zip(*xy, strict=True), style, color=color, label=mode)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.legend(fontsize=8)
        sc = scenarios.get(scen)
        fig.suptitle(f"{scen}" + (f" ({sc.lengths_text})" if sc else ""))
        fig.tight_layout()
        path = out / f"compare_{scen}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- CLI


def write_report(points: list[Point], meta: dict, out: Path, scenarios: dict) -> None:
    """compare.json, compare.md and the PNGs under `out`; prints the table and the paths."""
    doc = {
        "meta": meta,
        "points": [asdict(p) for p in points],
        "tpot_p99_ratio_disagg_over_colocated": ratios(points),
    }
    (out / "compare.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = markdown(points, meta, scenarios)
    (out / "compare.md").write_text(md)
    pngs = plot(points, out, scenarios)
    print()
    print(md)
    for path in [out / "compare.json", out / "compare.md", *pngs]:
        print(f"wrote {path}")
