"""benchmarks/trace_load.py at a small size: both reads keep the same window, and the
windowed one holds only the window's requests."""

from __future__ import annotations

import json

from benchmarks import trace_load


def test_the_windowed_read_holds_the_window_and_the_same_requests(tmp_path):
    out = tmp_path / "load.json"
    argv = ["--rows", "3000", "--rate", "10", "--start-s", "60", "--duration-s", "30"]
    assert trace_load.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["runs"]["whole"]["loaded"] == 3000
    held = doc["runs"]["windowed"]["loaded"]
    assert 200 < held < 400  # ~30 s of arrivals at 10 req/s
    assert doc["ratio"]["peak_rss_mb"] > 0
