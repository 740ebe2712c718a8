"""The bench plots are written as PNGs, also when there is nothing to plot."""

from __future__ import annotations

from pathlib import Path

from bench.metrics import RequestRecord
from bench.plots import TIMELINE, TPOT_CDF, TTFT_CDF, plot_results

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plots_with_mixed_records(tmp_path: Path):
    records = [
        RequestRecord(0, 0.0, 0.0, 8, 4, 4, 0.1, 0.4, [0.1] * 3),
        RequestRecord(1, 0.2, 0.3, 8, 1, 1, 0.05, 0.05),  # single token: no TPOT point
        RequestRecord(2, 0.3, 0.3, 8, 4, error="HTTP 500"),
    ]
    paths = plot_results(
        records, tmp_path / "new" / "dir", slo_ttft_ms=80, slo_tpot_ms=50, label="t"
    )
    assert [p.name for p in paths] == [TTFT_CDF, TPOT_CDF, TIMELINE]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_plots_when_every_request_failed(tmp_path: Path):
    paths = plot_results([RequestRecord(0, 0.0, 0.0, 8, 4, error="x")], tmp_path)
    assert [p.name for p in paths] == [TTFT_CDF, TPOT_CDF, TIMELINE]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)
    assert all(p.parent == tmp_path for p in paths)
