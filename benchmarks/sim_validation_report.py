"""What benchmarks/sim_validation.py shows of a run: the markdown table of the README, the log
lines of one workload, and the plot of live vs simulated CDFs. Reads the run's JSON entries
(one per workload: `workload`, `load`, `cpu`, `cells`, `requests`); computes nothing new.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot")
PERCENTILES = (50, 90)


def table(results: list[dict[str, Any]], tolerance: float) -> str:
    """The README's markdown table: one row per workload and metric; where the run measured
    co-run interference, the last column is the error the profile alone gives (p50 / p90)."""
    plain = any("cells_without_corun" in w for w in results)
    head = "| workload | req/s | requests | metric | live p50 | sim p50 | err p50 |"
    head += f" live p90 | sim p90 | err p90 | within {tolerance:.0%} |"
    head += " err without co-run (p50 / p90) |" if plain else ""
    lines = [head, "|" + "---|" * (12 if plain else 11)]
    for w in results:
        for metric in METRICS:
            c = _by_percentile(w["cells"], metric)
            cells = []
            for p in PERCENTILES:
                cells += [ms(c[p]["live_ms"]), ms(c[p]["sim_ms"]), pct(c[p]["rel_err"])]
            ok = all(c[p]["pass"] for p in PERCENTILES)
            row = (
                f"| {w['workload']['name']} | {w['load']['rate_rps']:.2f} | "
                f"{len(w['requests'])} | {metric.upper()} (ms) | "
                + " | ".join(cells)
                + f" | {'PASS' if ok else 'FAIL'} |"
            )
            if plain:
                c0 = _by_percentile(w.get("cells_without_corun", []), metric)
                errs = [pct(c0[p]["rel_err"]) if p in c0 else "-" for p in PERCENTILES]
                row += f" {' / '.join(errs)} |"
            lines.append(row)
    return "\n".join(lines)


def _by_percentile(cells: list[dict[str, Any]], metric: str) -> dict[int, dict[str, Any]]:
    return {x["percentile"]: x for x in cells if x["metric"] == metric}


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def describe(w: dict[str, Any]) -> list[str]:
    """Log lines of one judged workload: its load, the CPU around it, every cell."""
    cpu, load = w["cpu"], w["load"]
    wall = cpu["wall_s"] or 1.0
    lines = [
        f"  load: prefill worker {load['prefill_worker_load']:.0%}, decode-worker prefill "
        f"{load['decode_worker_prefill_load']:.0%}, sequences decoding live "
        f"{load['live_decoding_seqs']:.1f} / sim {load['sim_decoding_seqs']:.1f}; CPU cores: "
        f"server {cpu['server_s'] / wall:.2f}, client {cpu['client_s'] / wall:.2f}, "
        f"other jobs {cpu['foreign_cores']:.2f}"
    ]
    for c in w["cells"]:
        verdict = "PASS" if c["pass"] else "FAIL"
        lines.append(
            f"  {c['metric'].upper()} p{c['percentile']}: live {ms(c['live_ms'])} ms, "
            f"sim {ms(c['sim_ms'])} ms, {pct(c['rel_err'])} {verdict}"
        )
    if w["failed"]:
        lines.append(f"  {len(w['failed'])} live request(s) failed: {w['failed'][0]}")
    return lines


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Live vs simulated CDFs: a column per workload, TTFT above TPOT."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * max(1, len(results)), 7.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, max(1, len(results)), squeeze=False)
    for col, w in enumerate(results):
        for row, metric in enumerate(METRICS):
            ax = axes[row][col]
            for side, style, label in (("live", "-", "live"), ("sim", "--", "simulated")):
                xs = [q[f"{side}_{metric}_s"] for q in w["requests"] if q["error"] is None]
                xs = np.sort([1e3 * x for x in xs if x is not None and math.isfinite(x)])
                if xs.size:
                    ys = np.arange(1, xs.size + 1) / xs.size
                    ax.step(xs, ys, style, where="post", label=label)
            ax.set_title(f"{w['workload']['name']}: {metric.upper()}")
            ax.set_xlabel(f"{metric.upper()} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
