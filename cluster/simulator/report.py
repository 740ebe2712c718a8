"""What a simulation reports: the summary numbers, a compact table, the JSON document and the
replica-timeline plot (workers per pool over time, against the demand per window).

Figures are drawn on matplotlib's Agg canvas directly (no pyplot), as bench/plots.py does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from cluster.planner.types import POOLS
from cluster.simulator.run import SimResult
from router.signals import LatencySummary

RESULT_JSON = "simulation.json"
# The oscillation check: direction changes of a pool within any this many seconds.
DIRECTION_WINDOW_S = 600.0
TIMELINE_PNG = "replicas.png"
POOL_COLORS = {"prefill": "tab:orange", "decode": "tab:blue", "colocated": "tab:green"}


def percentiles_ms(samples_s: list[float]) -> dict[str, float | int]:
    """Nearest-rank p50/p90/p99 in ms of the samples that exist (NaN ones are skipped)."""
    s = LatencySummary.of([x for x in samples_s if not math.isnan(x)])
    return {"count": s.count, "p50": s.p50 * 1e3, "p90": s.p90 * 1e3, "p99": s.p99 * 1e3}


def gpu_hours_by_pool(result: SimResult, gpus_per_worker: int | dict[str, int]) -> dict[str, float]:
    """`gpus_per_worker`: one count for both pools, or pool -> its workers' GPUs (TP size)."""
    gpus = gpus_per_worker if isinstance(gpus_per_worker, dict) else None
    out = dict.fromkeys(POOLS, 0.0)
    for w in result.workers:
        left = result.end_s if math.isnan(w["left_s"]) else w["left_s"]
        g = gpus.get(w["pool"], 1) if gpus is not None else gpus_per_worker
        out[w["pool"]] += (left - w["asked_s"]) * g / 3600.0
    return {pool: h for pool, h in out.items() if h > 0}


def summarize(result: SimResult, gpus_per_worker: int | dict[str, int] = 1) -> dict:
    cfg = result.config
    return {
        "policy": result.policy,
        "requests": result.requests,
        "finished": result.finished,
        "unfinished": result.requests - result.finished,
        "met": result.met,
        "slo_results": result.slo_results(),
        "attainment": result.attainment,
        "gpu_hours": result.gpu_hours,
        "gpu_hours_by_pool": gpu_hours_by_pool(result, gpus_per_worker),
        "ttft_ms": percentiles_ms(result.ttft_s),
        "tpot_ms": percentiles_ms(result.tpot_s),
        "slo_ttft_ms": cfg.slo_ttft_s * 1e3,
        "slo_tpot_ms": cfg.slo_tpot_s * 1e3,
        "end_s": result.end_s,
        "wall_s": result.wall_s,
        "aborted": result.aborted,
        "decisions": len(result.decisions),
    }


def to_json(
    result: SimResult, gpus_per_worker: int | dict[str, int] = 1, extra: dict | None = None
) -> dict:
    """Everything about a run: summary, config, decisions with reasons, pool timeline, demand
    per window and each worker's lifetime."""
    cfg = result.config
    return {
        "summary": summarize(result, gpus_per_worker),
        "config": {name: getattr(cfg, name) for name in cfg.__dataclass_fields__},
        "decisions": result.decisions,
        "timeline": [
            {"t": t, "pool": pool, "ready": r, "starting": s, "draining": d}
            for t, pool, r, s, d in result.timeline
        ],
        "demand": result.demand,
        "workers": result.workers,
        **(extra or {}),
    }


def _json_safe(obj):
    """NaN and inf are not JSON: write them as null and strings."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(doc: dict, path: Path) -> Path:
    path.write_text(json.dumps(_json_safe(doc), indent=1) + "\n")
    return path


TABLE_COLUMNS = (
    "policy",
    "attain",
    "missed TTFT/TPOT/both",
    "GPU-h",
    "TTFT p50/p90/p99 ms",
    "TPOT p50/p90/p99 ms",
    "done",
)


def table_row(s: dict) -> tuple[str, ...]:
    def trio(p: dict) -> str:
        return "/".join("-" if math.isnan(p[k]) else f"{p[k]:.0f}" for k in ("p50", "p90", "p99"))

    return (
        s["policy"],
        f"{s['attainment']:.2%}",
        "/".join(str(s["slo_results"][k]) for k in ("missed_ttft", "missed_tpot", "missed_both")),
        f"{s['gpu_hours']:.2f}",
        trio(s["ttft_ms"]),
        trio(s["tpot_ms"]),
        f"{s['finished']}/{s['requests']}",
    )


def format_table(rows: list[tuple[str, ...]], header: tuple[str, ...] = TABLE_COLUMNS) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    head = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    return "\n".join([head, "  ".join("-" * w for w in widths), *lines])


def plot_timeline(result: SimResult, path: Path, title: str = "") -> Path:
    """Top: ready (solid), starting (dashed) and draining (dotted) workers per pool. Bottom:
    arriving prompt tokens/s (left axis) and output tokens/s (right axis) per window."""
    fig = Figure(figsize=(9, 6))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    scale, unit = (60.0, "min") if result.end_s > 1200 else (1.0, "s")
    for pool in POOLS:
        points = [(t, r, s, d) for t, p, r, s, d in result.timeline if p == pool]
        if not points:
            continue
        xs = [t / scale for t, *_ in points] + [result.end_s / scale]
        color = POOL_COLORS[pool]
        for col, style, label in ((1, "-", "ready"), (2, "--", "starting"), (3, ":", "draining")):
            ys = [pt[col] for pt in points]
            if not any(ys):
                continue
            if col != 1:  # starting/draining: drawn only while there are some
                ys = [y if y else math.nan for y in ys]
            top.step(
                xs, [*ys, ys[-1]], where="post", ls=style, color=color, label=f"{pool} {label}"
            )
    top.set_ylabel("workers")
    top.set_title(
        title or f"{result.policy}: {result.attainment:.2%} SLO, {result.gpu_hours:.2f} GPU-h"
    )
    top.grid(alpha=0.3)
    if top.get_legend_handles_labels()[0]:
        top.legend(loc="upper left", fontsize=8, ncol=3)
    if result.demand:
        xs = [(d["start_s"] + d["duration_s"]) / scale for d in result.demand]
        bottom.step(
            xs,
            [d["prompt_tokens_per_s"] for d in result.demand],
            where="pre",
            color="tab:orange",
            lw=0.8,
            label="prompt tokens/s",
        )
        right = bottom.twinx()
        right.step(
            xs,
            [d["output_tokens_per_s"] for d in result.demand],
            where="pre",
            color="tab:blue",
            lw=0.8,
            label="output tokens/s",
        )
        right.set_ylabel("output tokens/s", color="tab:blue")
    bottom.set_ylabel("prompt tokens/s", color="tab:orange")
    bottom.set_xlabel(f"simulated time ({unit})")
    bottom.grid(alpha=0.3)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def direction_changes(r: SimResult, window_s: float = DIRECTION_WINDOW_S) -> dict[str, int]:
    """Per pool: how often its provisioned size (ready + starting) turned from growing to
    shrinking or back, in all (`pool`) and at most within any `window_s`
    (`pool_max_per_10min`: oscillation)."""
    out: dict[str, int] = {}
    sizes: dict[str, list[tuple[float, int]]] = {}
    for t, pool, ready, starting, _ in r.timeline:
        sizes.setdefault(pool, []).append((t, ready + starting))
    for pool, series in sizes.items():
        turns, last_dir, prev = [], 0, None
        for t, n in series:
            if prev is not None and n != prev:
                d = 1 if n > prev else -1
                if last_dir and d != last_dir:
                    turns.append(t)
                last_dir = d
            prev = n
        most = max((sum(1 for u in turns if t <= u < t + window_s) for t in turns), default=0)
        out[pool] = len(turns)
        out[f"{pool}_max_per_10min"] = most
    return out
