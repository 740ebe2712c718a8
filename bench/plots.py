"""PNG plots of a `tandem bench serve` run: CDFs of TTFT and TPOT, and a per-request timeline.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so plotting never picks a
GUI backend nor changes matplotlib's global state for the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.metrics import RequestRecord

TTFT_CDF = "ttft_cdf.png"
TPOT_CDF = "tpot_cdf.png"
TIMELINE = "timeline.png"


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _cdf(values_ms: Sequence[float], title: str, xlabel: str, slo_ms: float | None) -> Figure:
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    if len(values_ms):
        xs = np.sort(np.asarray(values_ms, dtype=np.float64))
        ys = np.arange(1, xs.size + 1) / xs.size
        ax.step(xs, ys, where="post", label=f"{xs.size} requests")
        for p in (50, 90, 99):
            ax.axvline(np.percentile(xs, p), ls=":", lw=0.8, color="grey")
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", lw=1.0, label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    return fig


def _timeline(records: Sequence[RequestRecord], title: str) -> Figure:
    """One row per request: a thin line from arrival to send (queued by the concurrency
    limit), a light bar from send to first token (TTFT) and a dark bar to the end (decode)."""
    fig = Figure(figsize=(8, max(3.0, min(12.0, 0.04 * len(records) + 2.5))))
    ax = fig.add_subplot()
    ok = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    if ok:
        idx = np.array([r.index for r in ok])
        arrival = np.array([r.arrival_s for r in ok])
        start = np.array([r.start_s for r in ok])
        first = start + np.array([r.ttft_s for r in ok])
        end = start + np.array([r.e2e_s for r in ok])
        # Thick line collections rather than bars: thousands of bar patches take many seconds.
        height_pt = fig.get_figheight() * 72 * 0.8
        lw = max(0.3, min(8.0, 0.8 * height_pt / max(1, len(records))))
        ax.hlines(idx, arrival, start, color="grey", lw=0.8, label="queued")
        ax.hlines(idx, start, first, color="tab:orange", lw=lw, label="TTFT")
        ax.hlines(idx, first, end, color="tab:blue", lw=lw, label="decode")
        if len(records) <= 300:  # beyond that the tick marks hide the bars
            ax.plot(arrival, idx, "k|", ms=4, label="arrival")
    if bad:
        ax.plot([r.arrival_s for r in bad], [r.index for r in bad], "rx", ms=5, label="failed")
    ax.set_xlabel("seconds since benchmark start")
    ax.set_ylabel("request")
    ax.set_title(title)
    ax.invert_yaxis()
    ax.grid(alpha=0.3, axis="x")
    if records:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig


def plot_results(
    records: Sequence[RequestRecord],
    out_dir: str | Path,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    label: str = "",
) -> list[Path]:
    """Write ttft_cdf.png, tpot_cdf.png and timeline.png into `out_dir`; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f" — {label}" if label else ""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s * 1000.0 for r in ok]
    tpots = [t * 1000.0 for t in (r.tpot_s for r in ok) if t is not None]
    return [
        _save(_cdf(ttfts, f"TTFT CDF{suffix}", "TTFT (ms)", slo_ttft_ms), out / TTFT_CDF),
        _save(_cdf(tpots, f"TPOT CDF{suffix}", "TPOT (ms)", slo_tpot_ms), out / TPOT_CDF),
        _save(_timeline(records, f"Requests over time{suffix}"), out / TIMELINE),
    ]
